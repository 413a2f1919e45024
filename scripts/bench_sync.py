"""Weight-sync figures of rollout=vllm_server: time per push and the sender's peak extra memory (RSS above its
level before the push, sampled every 5 ms), bucketed (sync.bucket_mb, default 256) against whole-model (one
bucket holding everything), for the tiny model and a random ~100M-parameter Qwen3; int8 pre-quantized and
unquantized; per transfer backend: qarl_shm (the server reads the bucket files) and qarl_gloo (their tensors are
broadcast to it over TCP, as to a server on another node). One real vLLM server on 127.0.0.1 per case.

    .venv/bin/python scripts/bench_sync.py [--out bench_sync.json] [--repeats 3] [--skip-100m]
        [--backends qarl_shm,qarl_gloo]

Prints a table and writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _bench import table


def random_qwen3(out: Path, tokenizer_from: Path) -> Path:
    """A random Qwen3 of ~100M parameters (8 layers, hidden 1024) with the tiny model's tokenizer, in bf16."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(str(tokenizer_from))
    config = AutoConfig.for_model("qwen3", vocab_size=len(tok), hidden_size=1024, intermediate_size=3072,
                                  num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                                  max_position_embeddings=512, tie_word_embeddings=False,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    for f in ("generation_config.json",):
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, out / f)
    return out


class PeakRSS:
    """The process's resident memory, sampled in a thread: peak minus the level at start."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.done = False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self.done = True
        self.thread.join()

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def case(src: Path, quant: str, dtype: str, bucket_mb: int, repeats: int, backend: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from qarl_cli.config.quant import SCHEMAS
    from qarl_cli.config.stages import InplaceSyncConfig, VLLMServerRolloutConfig
    from qarl_cli.quant import build_scheme
    from qarl_cli.forward.aligned import align
    from qarl_cli.quant.checkpoint import load_meta_model, plan_for
    from qarl_cli.sync.inplace import InplaceSync
    from qarl_cli.rollout.vllm_server import ServerEngine

    scheme = build_scheme(SCHEMAS[quant](), "cpu")
    engine = ServerEngine(VLLMServerRolloutConfig(kv_cache_memory_bytes=1 << 28, transfer_backend=backend), src,
                          scheme, dtype=dtype, seed=0, max_model_len=128)
    try:
        trainer = align(AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype)), scheme)
        params = sum(p.numel() for p in trainer.parameters())
        sync = InplaceSync(InplaceSyncConfig(bucket_mb=bucket_mb), scheme, plan_for(load_meta_model(src), scheme))
        sync.push(trainer, engine)  # first push: the transfer engines' handshake
        times, extra, sent = [], [], 0
        for _ in range(repeats):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(1.0001)
            with PeakRSS() as rss:
                metrics = sync.push(trainer, engine)
            times.append(metrics["time/sync"])
            extra.append(rss.extra_mb)
            sent = sum(p.stat().st_size for p in sync.transfer.current)
        sync.close()
    finally:
        engine.close()
    return {"backend": backend, "model": src.name, "params_M": round(params / 1e6, 1), "quant": quant,
            "bucket_mb": bucket_mb if bucket_mb < 10**6 else "whole", "sent_mb": round(sent / 2**20, 1),
            "buckets": int(metrics["sync/buckets"]), "sync_s": round(statistics.median(times), 3),
            "peak_extra_rss_mb": round(max(extra), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_sync.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-100m", action="store_true")
    parser.add_argument("--backends", default="qarl_shm,qarl_gloo")
    args = parser.parse_args()

    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(TinyModelConfig(), log=lambda _: None)
    cases = [(tiny, q, "float32", b) for q in ("none", "int8") for b in (256, 10**7)]
    if not args.skip_100m:
        big = random_qwen3(Path(tempfile.gettempdir()) / "qarl-bench-qwen3-100m", tiny)
        cases += [(big, q, "bfloat16", b) for q in ("none", "int8") for b in (32, 10**7)]
    rows = [case(src, q, dtype, b, args.repeats, backend) for backend in args.backends.split(",")
            for src, q, dtype, b in cases]
    table("weight sync into one vLLM server (RL API)", rows)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
