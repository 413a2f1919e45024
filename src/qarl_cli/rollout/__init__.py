"""The rollout stage: engines that sample responses with per-token logprobs (base.py holds the contract), the
checks every weight load goes through (weights.py), and the in-place sync that keeps an engine on the trainer's
quantized weights (sync.py). vLLM is imported only inside vllm_engine.py."""
