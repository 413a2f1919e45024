"""`qarl COMMAND [hydra overrides]`. This module imports neither torch nor Hydra: `qarl --help` stays instant."""

from __future__ import annotations

import os
import sys

from qarl_cli.config.usage import COMMANDS, TOOLS

USAGE = """usage: qarl COMMAND [OVERRIDES ...] [--help] [--cfg job] [-m]

Rollout-aligned quantization-aware RL for LLM reasoning, configured with Hydra.

commands:
{commands}

examples:
  qarl train                                    embedded default: tiny model, arithmetic, CPU
  qarl train +experiment=qwen3_30b_a3b_fp8      the paper's setting (GPU cluster)
  qarl train -m algorithm=tbpo,grpo seed=0,1    a multirun sweep
  qarl quantize model.path=CKPT quant=w4a16 out=CKPT-w4a16
  qarl eval model.path=CKPT data=math500 data.path=math500.jsonl quant=fp8_block
  qarl serve model.path=CKPT quant=fp8_block rollout.host=ADDR rollout.api_key=KEY
                                                a server for a run on another node (docs/scaling.md)
  qarl plot outputs/DATE/RUN multirun/DATE/SWEEP  curves of runs (or a sweep's jobs) on the same axes
  qarl compare multirun/DATE/SWEEP runs/other     a sweep's closing comparison, for runs made apart

`qarl COMMAND --help` lists the command's config groups and options; `--cfg job` prints the composed config."""


def usage() -> str:
    listed = {**COMMANDS, **TOOLS}
    width = max(map(len, listed))
    return USAGE.format(commands="\n".join(f"  {c.ljust(width)}  {h}" for c, h in listed.items()))


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # inside the try: a reader that went away (`qarl --help | head`) is not a crash
        return code
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so that the interpreter's own flush at exit is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command its pipe's reader left


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from qarl_cli import __version__

        print(f"qarl {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in TOOLS:  # directories in, no config: argparse, without Hydra
        from qarl_cli.results.cli import main as tool

        return tool(command, rest, TOOLS[command])
    if command not in COMMANDS:
        print(f"qarl: unknown command {command!r}; choose from: {', '.join([*COMMANDS, *TOOLS])}", file=sys.stderr)
        return 2
    from qarl_cli.cli.app import run_command  # Hydra, and through the command torch, only from here on

    return run_command(command, rest)


if __name__ == "__main__":
    sys.exit(main())
