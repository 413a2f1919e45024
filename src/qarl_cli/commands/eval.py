"""`qarl eval`: not implemented in this version (it needs a rollout engine)."""

from pathlib import Path

from qarl_cli.config.root import EvalConfig
from qarl_cli.stages import StageUnavailable


def run(cfg: EvalConfig, run_dir: Path) -> int:
    raise StageUnavailable(f"qarl eval: rollout={cfg.rollout.name} has no implementation in this version of qarl")
