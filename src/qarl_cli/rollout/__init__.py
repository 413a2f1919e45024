"""The rollout stage: engines that sample responses with per-token logprobs (base.py holds the contract): the torch
engine, vLLM in this process (vllm_engine.py) and vLLM servers (vllm_server.py, server_process.py, server_auth.py).
How new weights reach an engine is the sync stage's (qarl_cli.sync). vLLM is imported only inside the vLLM engines."""
