"""Mixture-of-experts routing: rollout routing replay (routing.py) and its metrics (metrics.py)."""
