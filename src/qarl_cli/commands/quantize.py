"""`qarl quantize model.path=DIR quant=SCHEME out=DIR`: write a checkpoint that vLLM loads as that scheme
(int8 and w4a16 in the compressed-tensors layout, fp8_block in the `fp8` block layout), with the tokenizer and
generation config, shard by shard. The int8 weight range follows `device` (see quant.weight_qmax)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.root import QuantizeConfig


def check_paths(cfg: QuantizeConfig, run_dir: Path) -> None:
    """At compose time, before Hydra creates anything: what `out` would replace (machine.disk)."""
    from qarl_cli.machine.disk import refuse_overlap, replaceable

    out = Path(os.path.expanduser(cfg.out))
    if (out.exists() or out.is_symlink()) and not cfg.overwrite:
        raise ConfigError(f"out={cfg.out!r} already exists; pass overwrite=true to replace it")
    why = "the output must be a directory of its own, apart from the checkpoint it is made from"
    refuse_overlap("out", out, [("model.path", cfg.model.path)], why)
    refuse_overlap("out", out, [("hydra.run.dir", run_dir)], "quantize.json goes to the run directory: give the "
                   "checkpoint a directory of its own")
    if cfg.overwrite:
        replaceable("out", out)


def run(cfg: QuantizeConfig, run_dir: Path) -> int:
    from qarl_cli.models.resolve import model_dir
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.checkpoint import write_checkpoint

    out = Path(os.path.expanduser(cfg.out))
    check_paths(cfg, run_dir)  # again: the disk may have changed since (write_checkpoint checks at the rename too)
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
