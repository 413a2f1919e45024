"""What the aligned forward holds per rank under FSDP2: the bytes of quantized weights its modules keep after a
forward and backward (the Wq cache), and the bytes autograd saves for the backward other than the gathered masters
(activations, and Wq where the backward keeps it), with the cache (as in one
process) against without it (what `Distributed.shard` sets), next to the rank's shard of the parameters. A random
Qwen3 of 4 layers, int8, one forward + backward of 4 x 64 tokens.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 scripts/bench_fsdp_memory.py [--out fsdp_memory.json]

Prints a table and writes JSON (rank 0)."""

from __future__ import annotations

import argparse
import json


def held_bytes(model) -> int:
    from qarl_cli.forward.aligned import _Cached

    total = 0
    for m in model.modules():
        if isinstance(m, _Cached) and m._value is not None:
            values = m._value if isinstance(m._value, tuple) else (m._value,)
            for v in values:
                for t in (v.values() if isinstance(v, dict) else [v]):
                    total += t.numel() * t.element_size()
    return total


def one(keep: bool, dist) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qarl_cli.config.quant import Int8Config
    from qarl_cli.quant import build_scheme
    from qarl_cli.forward.aligned import align, keep_cache

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    model = align(Qwen3ForCausalLM(config), build_scheme(Int8Config(), "cpu"))
    dist.shard(model)  # sets keep_cache(model, False)
    keep_cache(model, keep)
    from torch.distributed.tensor import DTensor

    saved = [0]

    def pack(t):
        # FSDP frees a layer's gathered masters after its forward and gathers them again for its backward, so a
        # saved master costs nothing in between; everything else saved lives until its layer's backward
        gathered = {p.untyped_storage().data_ptr() for p in model.parameters() if not isinstance(p, DTensor)}
        if t.untyped_storage().data_ptr() not in gathered:
            saved[0] += t.numel() * t.element_size()
        return t

    ids = torch.randint(0, 2048, (4, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).logits.float().square().mean()
    loss.backward()
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"aligned cache": "kept (one process)" if keep else "none (FSDP)", "rank shard MB": round(shard / 1e6, 2),
            "Wq held after backward MB": round(held_bytes(model) / 1e6, 2),
            "saved for backward (not masters) MB": round(saved[0] / 1e6, 2)}


def main() -> None:
    from _bench import table

    from qarl_cli.update.distributed import from_env

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fsdp_memory.json")
    args = parser.parse_args()
    dist = from_env("cpu")
    rows = [one(keep, dist) for keep in (True, False)]
    if dist.main:
        table(f"aligned forward under FSDP2, {dist.world} ranks, per rank (rank 0)", rows)
        with open(args.out, "w") as f:
            json.dump({"world": dist.world, "rows": rows}, f, indent=1)
    dist.close()


if __name__ == "__main__":
    main()
