"""Typed configuration schemas (one module per group) and their registration with Hydra (registry.py)."""
