"""qarl: rollout-aligned quantization-aware RL for LLM reasoning."""

__version__ = "0.1.0"
