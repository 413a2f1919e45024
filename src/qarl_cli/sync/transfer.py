"""Weights into vLLM engines through vLLM's RL API: the servers of rollout=vllm_server, or the in-process engine of
rollout=vllm (its LLM's RL methods, the same sequence).

One push: the trainer's checkpoint-format tensors are checked and written as bucket files (sync.buckets). Only when
every bucket is written does any server hear of it; then each server, in parallel (nccl: one after another), gets
/pause?mode=wait, the backend's update round (sync.backends: vLLM's trainer-side transfer engine, which drives
/start_weight_update -> /update_weights -> /finish_weight_update {weight_version}), and /resume.

When the sync's verify is due, every server's `/weight_checker` checksums are then compared with the digests of
the sent tensors it keeps as sent (sync.checksums); a server holding anything else counts as failed.
If any server fails any of these, every server is put back on the previous version (its buckets, kept until the
next push succeeds, are sent again; a launched server that cannot take them is restarted, which before the first
push is the start-up checkpoint): never half-updated. An attached server that cannot be put back (qarl cannot
restart it) is taken out of the run's use and left paused, so that no client samples from its half-loaded weights,
and the error says so. vLLM's RL API has no rollback of its own: this is qarl's."""

from __future__ import annotations

import shutil
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from qarl_cli.rollout.base import WeightSyncError
from qarl_cli.sync.buckets import FILE_PREFIX, engine_held, write_buckets
from qarl_cli.sync.checksums import engine_checksums, kept_as_sent, mismatches


# engine -> the names its checksums can check, measured on the engine as it started (sync.checksums)
_CHECKABLE: "weakref.WeakKeyDictionary[Any, frozenset[str]]" = weakref.WeakKeyDictionary()


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
        # The names a push can be checked on (sync.checksums), measured on the first server as it started
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
        from qarl_cli.sync.backends import Transport

        self.transport = Transport(engine.cfg, self.init_info)
        for server in engine.weight_receivers():
            self.transport.init(server)
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
            retired = self._roll_back(servers)
            for p in paths:
                p.unlink(missing_ok=True)
            first = next(iter(errors.values()))
            back = f"every server was put back on weight version {self.version}" if not retired else (
                f"{'; '.join(retired)}; the others were put back on weight version {self.version}")
            raise WeightSyncError(f"sync: {len(errors)} of {len(servers)} servers failed the weight update "
                                  f"(server {next(iter(errors))}: {first}); {back}")
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
                self.transport.send(server, paths, version)
                return None
            except Exception as e:  # noqa: BLE001 - reported, and the server rolled back
                return f"{type(e).__name__}: {e}"
        # In this thread for one server (an in-process engine's update runs here, Ctrl-C lands here) or a transport
        # that sends to one at a time
        if len(servers) == 1 or not self.transport.parallel:
            results = [one(s) for s in servers]
        else:
            with ThreadPoolExecutor(len(servers)) as pool:
                results = list(pool.map(one, servers))
        return {s.index: r for s, r in zip(servers, results) if r is not None}

    def _roll_back(self, servers: list) -> list[str]:
        """Every server back on the current version; what was said of those that could not be (taken out of use)."""
        retired = []
        for server in servers:
            why = "no earlier version of this run to send"
            if self.current:
                try:
                    self.transport.send(server, self.current, self.version)
                    continue
                except Exception as e:  # noqa: BLE001 - then a restart, which replays
                    why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if server.command is None:  # attached: qarl cannot restart it; the failed round left it paused
                retired.append(self.engine.retire(server, f"could not be put back ({why})"))
                continue
            server.stop()
            server.start(self.engine.cfg.startup_timeout_s)
            self.replay(server)
        return retired

    def replay(self, server: Any) -> None:
        """Bring a (re)started server to the current version."""
        self.transport.init(server)
        if self.current:
            self.transport.send(server, self.current, self.version)

    def close(self) -> None:
        if self.replay in self.engine.on_restart:  # a server restarted later is no longer this transfer's
            self.engine.on_restart.remove(self.replay)
        self.transport.close()
        shutil.rmtree(self.directory, ignore_errors=True)

