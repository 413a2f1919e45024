"""`qarl quantize model.path=DIR quant=SCHEME out=DIR`: write a checkpoint that vLLM loads as that scheme
(int8 and w4a16 in the compressed-tensors layout, fp8_block in the `fp8` block layout), with the tokenizer and
generation config, shard by shard. The int8 weight range follows `device` (see quant.weight_qmax)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.root import QuantizeConfig


def run(cfg: QuantizeConfig, run_dir: Path) -> int:
    from qarl_cli.models.resolve import model_dir
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.checkpoint import write_checkpoint

    out = Path(os.path.expanduser(cfg.out))
    if out.exists() and not cfg.overwrite:  # before building or reading any model
        raise ConfigError(f"out={cfg.out!r} already exists; pass overwrite=true to replace it")
    src = model_dir(cfg.model)
    scheme = build_scheme(cfg.quant, cfg.device)
    summary = write_checkpoint(src, out, scheme, overwrite=cfg.overwrite,
                               trust_remote_code=cfg.model.trust_remote_code)
    summary["model"] = str(src)
    if getattr(scheme, "weight_qmax", None) is not None:
        summary["weight_qmax"] = scheme.weight_qmax
    (run_dir / "quantize.json").write_text(json.dumps(summary, indent=2) + "\n")
    what = (f"{summary['quantized']} weights quantized, left unquantized: {', '.join(summary['kept']) or 'none'}"
            if scheme.quantizes_weights else "weights copied unchanged")
    print(f"[qarl] quant={scheme.name}: {what}; {summary['weights_bytes'] / 2**20:.1f} MiB of weights -> {out} "
          f"({summary['seconds']} s)")
    return 0
