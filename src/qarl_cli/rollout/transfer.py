"""Weights into vLLM servers through vLLM's RL API (the data plane: rollout.channels, `rollout.transfer_backend`).

One push: the trainer's checkpoint-format tensors are checked one by one (names, shapes, dtypes, finite values
against what the servers serve) and written as buckets of at most `bucket_bytes` (safetensors files in host
shared memory), so the sender holds one bucket at a time, never the model. Only when every bucket is written
does any server hear of it; then each server, in parallel (nccl: one after another):

    /pause?mode=wait -> /start_weight_update -> /update_weights (one call per bucket)
    -> /finish_weight_update {weight_version} -> /resume

When the sync's verify is due, every server's `/weight_checker` checksums are then compared with the digests of
the sent tensors it keeps as sent (rollout.checksums); a server holding anything else counts as failed.
If any server fails any of these, every server is put back on the previous version (its buckets, kept until the
next push succeeds, are sent again; a server that cannot take them is restarted, which before the first push is
the start-up checkpoint): never half-updated.
With `qarl_shm` the servers read the files (one node); with `qarl_gloo` or `nccl` their tensors are broadcast to
each server's workers (any node), and the files stay on the trainer's node as what a rollback resends."""

from __future__ import annotations

import shutil
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from qarl_cli.rollout.base import WeightSyncError
from qarl_cli.rollout.checksums import digest, engine_checksums, kept_as_sent, mismatches
from qarl_cli.rollout.vllm_transfer import FILE_PREFIX
from qarl_cli.rollout.weights import checked


def write_buckets(weights: Iterable[tuple[str, torch.Tensor]], spec, aliases, directory: Path, version: str,
                  bucket_bytes: int, engine: str, digests: Optional[dict] = None) -> tuple[list[Path], int]:
    """The checked weights as bucket files in `directory`; (paths, peak bytes held in one bucket). A bad tensor
    raises WeightSyncError before any server is touched (the files written so far are removed by the caller).
    digests: {name: dtype} of the tensors to hash as written (rollout.checksums); replaced by {name: sha256}."""
    from safetensors.torch import save_file

    paths: list[Path] = []
    bucket: dict[str, torch.Tensor] = {}
    size = peak = 0

    def flush() -> None:
        nonlocal bucket, size
        if bucket:
            path = directory / f"{FILE_PREFIX}{version}-{len(paths):05d}.safetensors"
            save_file(bucket, str(path))
            paths.append(path)
        bucket, size = {}, 0

    # Tied pairs (alias -> the name the server stores it under): the alias is compared with its target once
    # both came, then dropped; the servers store the tensor once.
    targets: dict[str, torch.Tensor] = {}
    waiting: dict[str, torch.Tensor] = {}  # aliases that came before their target

    def same(alias: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if not torch.equal(a, b):
            raise WeightSyncError(f"{engine}: weight {alias!r} differs from {aliases[alias]!r}, which the served "
                                  "model ties it to (tie_word_embeddings); the engine kept its old weights")

    seen: set[str] = set()
    for name, tensor in weights:
        if name in seen:
            raise WeightSyncError(f"{engine}: weight {name!r} sent twice; the engine kept its old weights")
        seen.add(name)
        if name in aliases:
            if aliases[name] in targets:
                same(name, tensor, targets[aliases[name]])
            else:
                waiting[name] = tensor
            continue
        if name in aliases.values():
            targets[name] = tensor
            for alias in [a for a in waiting if aliases[a] == name]:
                same(alias, waiting.pop(alias), tensor)
        items = [(name, tensor)]
        for name, tensor in checked(items, spec, engine):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                flush()
            bucket[name] = tensor.detach().cpu().contiguous()
            if digests is not None and name in digests:
                digests[name] = digest(bucket[name], digests[name])
            size += nbytes
            peak = max(peak, size)
    flush()
    for alias, tensor in waiting.items():  # its target never came: the server has no weight of that name
        checked([(alias, tensor)], spec, engine)
    return paths, peak


# engine -> the names its checksums can check, measured on the engine as it started (rollout.checksums)
_CHECKABLE: "weakref.WeakKeyDictionary[Any, frozenset[str]]" = weakref.WeakKeyDictionary()


def engine_held(spec: dict, source: dict, served: dict, engine_dtype: torch.dtype) -> dict:
    """The dtypes a push sends. A float tensor the engine serves as it is in the source checkpoint (norms,
    embeddings, unquantized linears) is held in the dtype the engine runs in, not the one it was stored in:
    SmolLM2's checkpoint is bf16 and its engine fp32, and its fp32 masters cast to bf16 left the engine 0.02
    (mean |logprob|) from the trainer after every sync, on every scheme. The tensors a scheme writes (int8 weights
    and their fp32 scales, packed int4, fp8) go as the served checkpoint stores them, and the masters that
    sync.mode=online sends to be quantized keep their precision."""
    def held(name: str, dtype: torch.dtype) -> bool:
        kept = served.get(name, (None, torch.int8))[1]
        return name in source and dtype.is_floating_point and kept.is_floating_point and kept.itemsize > 1
    return {name: (shape, engine_dtype if held(name, dtype) else dtype) for name, (shape, dtype) in spec.items()}


class RLApiTransfer:
    """sync=inplace for a vLLM engine (`weight_receivers()`: the servers of rollout=vllm_server, or the in-process
    engine of rollout=vllm)."""

    def __init__(self, engine: Any, directory: Path, bucket_bytes: int, online: Optional[dict] = None,
                 checksums: bool = False) -> None:
        from qarl_cli.quant.checkpoint import load_meta_model
        from qarl_cli.rollout.vllm_engine import checkpoint_spec
        from qarl_cli.rollout.weights import tied_aliases

        self.engine, self.directory, self.bucket_bytes = engine, Path(directory), bucket_bytes
        # The tensors a push may send: the served (low-bit) checkpoint's, or for online the unquantized ones; a
        # tied model's checkpoint stores the embedding once, and the trainer sends it under both names.
        self.spec = engine_held(checkpoint_spec(engine.source if online else engine.served),
                                checkpoint_spec(engine.source), checkpoint_spec(engine.served), engine.dtype)
        self.aliases = tied_aliases(load_meta_model(engine.source), self.spec)
        # The names a push can be checked on (rollout.checksums), measured on the first server as it started
        self.checked: frozenset[str] = frozenset()
        if checksums:
            if engine not in _CHECKABLE:  # once per engine: later it may no longer serve its start checkpoint
                first = engine.weight_receivers()[0]
                _CHECKABLE[engine] = kept_as_sent(engine_checksums(first), engine.served, engine.dtype)
            self.checked = _CHECKABLE[engine]
        self.current: list[Path] = []  # the buckets of the version the servers serve ([]: the start checkpoint)
        self.version = "0"
        # sync.mode=online: the quant config and unquantized checkpoint the worker quantizes with; {}: prequantized
        self.init_info = {"quant": online["quant"], "source": online["source"]} if online else {}
        from qarl_cli.rollout.channels import channel_for

        self.channel = channel_for(engine.cfg)
        for server in engine.weight_receivers():
            self.channel.init(server, self.init_info)
        engine.on_restart.append(self.replay)

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: str, check: bool = False
             ) -> dict[str, float]:
        """check: compare every server's checksums with the sent tensors' (those in self.checked) before the
        push counts as done; a mismatch puts every server back on the previous version and names the tensor."""
        start = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        sent = {name: self.engine.dtype for name in self.checked} if check and self.checked else None
        try:
            paths, peak = write_buckets(weights, self.spec, self.aliases, self.directory, version,
                                        self.bucket_bytes, f"rollout={self.engine.name}", sent)
        except BaseException:
            for p in self.directory.glob(f"{FILE_PREFIX}{version}-*"):
                p.unlink(missing_ok=True)
            raise
        written = time.perf_counter() - start
        servers = self.engine.weight_receivers()
        errors = self._to_all(servers, paths, version)
        if sent:  # the checked names this push sent (a push may leave tensors as they are)
            sent = {name: d for name, d in sent.items() if isinstance(d, str)}
        if not errors and sent:
            errors = self._compare(servers, sent)
        if errors:
            self._roll_back(servers)
            for p in paths:
                p.unlink(missing_ok=True)
            first = next(iter(errors.values()))
            raise WeightSyncError(f"sync: {len(errors)} of {len(servers)} servers failed the weight update "
                                  f"(server {next(iter(errors))}: {first}); every server was put back on weight "
                                  f"version {self.version}")
        for p in self.current:
            p.unlink(missing_ok=True)
        self.current, self.version = paths, version
        metrics = {"time/sync_write": written, "sync/buckets": float(len(paths)), "sync/bucket_peak_mb": peak / 2**20}
        if sent:
            metrics["sync/checksummed"] = float(len(sent))
        return metrics

    def _compare(self, servers: list, sent: dict[str, str]) -> dict[int, str]:
        """Per server that does not hold what was sent: the first tensors that differ."""
        errors = {}
        for server in servers:
            bad = mismatches(engine_checksums(server), sent)
            if bad:
                errors[server.index] = (f"/weight_checker: {len(bad)} of {len(sent)} checked tensors differ from "
                                        f"what the trainer sent, first {bad[0]!r}")
        return errors

    def _to_all(self, servers: list, paths: list[Path], version: str) -> dict[int, str]:
        def one(server) -> Optional[str]:
            try:
                self.channel.send(server, paths, version)
                return None
            except Exception as e:  # noqa: BLE001 - reported, and the server rolled back
                return f"{type(e).__name__}: {e}"
        # In this thread for one server (an in-process engine's update runs here, Ctrl-C lands here) or a channel
        # that sends to one at a time
        if len(servers) == 1 or not self.channel.parallel:
            results = [one(s) for s in servers]
        else:
            with ThreadPoolExecutor(len(servers)) as pool:
                results = list(pool.map(one, servers))
        return {s.index: r for s, r in zip(servers, results) if r is not None}

    def _roll_back(self, servers: list) -> None:
        for server in servers:
            if self.current:
                try:
                    self.channel.send(server, self.current, self.version)
                    continue
                except Exception:  # noqa: BLE001 - then a restart, which replays
                    pass
            if server.command is None:
                raise RuntimeError(f"sync: the engine ({server.url}) failed half-way through its first weight "
                                   "update and qarl cannot restart it; restart the run from its last checkpoint")
            server.stop()
            server.start(self.engine.cfg.startup_timeout_s)
            self.replay(server)

    def replay(self, server: Any) -> None:
        """Bring a (re)started server to the current version."""
        self.channel.init(server, self.init_info)
        if self.current:
            self.channel.send(server, self.current, self.version)

    def close(self) -> None:
        if self.replay in self.engine.on_restart:  # a server restarted later is no longer this transfer's
            self.engine.on_restart.remove(self.replay)
        self.channel.close()
        shutil.rmtree(self.directory, ignore_errors=True)

