"""`qarl quantize`: not implemented in this version (the quantization schemes land with the quant stage)."""

from pathlib import Path

from qarl_cli.config.root import QuantizeConfig
from qarl_cli.stages import StageUnavailable


def run(cfg: QuantizeConfig, run_dir: Path) -> int:
    raise StageUnavailable(f"qarl quantize: quant={cfg.quant.name} has no implementation in this version of qarl")
