"""rollout=vllm_server: `rollout.num_servers` real vLLM OpenAI servers, which qarl launches and stops, or attaches
to (`rollout.urls`). Generation goes over HTTP with token ids in and token ids plus per-token logprobs out
(/v1/completions with `return_token_ids` and `logprobs`), spread over the servers with a bounded number of
requests in flight; weights arrive through vLLM's RL routes, driven by the sync (sync.transfer).

A server that dies mid-rollout is restarted (or dropped, `restart_failed=false`) and the requests it had not
answered go to a live one: a request's samples are recorded once, when its answer arrives, and a request carries
its seed, so a resubmitted request samples what it would have. A restarted server comes back on the weights of
its start-up checkpoint; the sync replays the current version into it before it serves again (`on_restart`).

Launched servers run in their own process groups, with the parent-death signal set: close() (reached on a normal
end, an error, Ctrl-C and SIGTERM through qarl_cli.machine.signals) ends each group, and a qarl killed outright takes its
servers with it."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from qarl_cli.config.errors import UserError
from qarl_cli.rollout import server_check
from qarl_cli.rollout.base import RolloutBatch
from qarl_cli.rollout.routing import checked, resolve_routing
from qarl_cli.rollout.server_auth import KEY_ENV
from qarl_cli.rollout.server_launch import MODEL_NAME, check_capacity, server_command
from qarl_cli.rollout.server_process import NAME, Server, ServerDied, _free_port

log = logging.getLogger("qarl")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
STARTING_AT_ONCE = 4  # servers loading at the same time


class ServerEngine:
    name = "vllm_server"

    def __init__(self, cfg: Any, model_dir: Path, scheme: Any, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: Optional[int] = None, device: str = "auto",
                 workdir: Optional[Path] = None, log_dir: Optional[Path] = None) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise UserError(f"{NAME}: vLLM is not installed ({e}); use rollout=torch") from None
        import torch

        from qarl_cli.rollout.vllm_engine import _scratch_dir

        self.cfg, self.scheme = cfg, scheme
        self.source = Path(model_dir)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.on_restart: list[Callable[[Server], None]] = []
        self.servers: list[Server] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.restarting = 0  # restarts under way: requests wait for them rather than give up
        self.scratch = _scratch_dir(workdir)
        self._remove_scratch = weakref.finalize(self, shutil.rmtree, str(self.scratch), ignore_errors=True)
        self.key = cfg.api_key or os.environ.get(KEY_ENV) or secrets.token_urlsafe(24)
        self.routing_replay, self.routing_note = resolve_routing(cfg, self.source, NAME)
        try:
            # What the servers serve: the source, or its low-bit checkpoint (`qarl quantize`). Attached servers
            # load their own copy; this one is what the sync reads the tensors a push sends (and their digests) from.
            served = self._served_checkpoint()
            from qarl_cli.machine import capabilities

            dtype = capabilities.for_engine(scheme.cfg, self.source, device, self.name).dtype or dtype
            self.identity = server_check.identity(self.source, served, scheme.name)
            if cfg.urls:
                self.servers = [Server(i, u, self.key, timeout=cfg.request_timeout_s, attach_grace=cfg.attach_grace_s)
                                for i, u in enumerate(cfg.urls)]
            else:
                on_gpu = torch.cuda.is_available() and device != "cpu"
                check_capacity(cfg, torch.cuda.device_count() if on_gpu else 0)
                self.servers = [self._launch(i, served, dtype, seed, max_model_len, on_gpu)
                                for i in range(cfg.num_servers)]
            self.served, self.dtype = served, getattr(torch, dtype)
            start = time.perf_counter()
            self._start_all()
            self.startup_seconds = time.perf_counter() - start
            for server in self.servers:  # before a sample is drawn or a byte is sent
                server_check.check(server, self.identity, dtype, cfg.transfer_backend)
            self.live = list(self.servers)
        except BaseException:
            self.close()
            raise

    def _start_all(self) -> None:
        """Every server started, at most STARTING_AT_ONCE loading at a time (each takes the cores it is given, and
        more at once leave the machine unusable), and given up as soon as one fails or Ctrl-C comes: the caller
        stops them all, which ends the starts still waiting."""
        pool = ThreadPoolExecutor(min(len(self.servers), STARTING_AT_ONCE))
        try:
            for future in [pool.submit(s.start, self.cfg.startup_timeout_s) for s in self.servers]:
                future.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _served_checkpoint(self) -> Path:
        if not self.scheme.quantizes_weights:
            return self.source
        from qarl_cli.quant.checkpoint import write_checkpoint

        served = self.scratch / "checkpoint"
        write_checkpoint(self.source, served, self.scheme, progress=False)
        return served

    def _launch(self, i: int, served: Path, dtype: str, seed: int, max_model_len: Optional[int],
                on_gpu: bool) -> Server:
        cfg = self.cfg
        port = cfg.base_port + i if cfg.base_port else _free_port(cfg.host)
        cmd, env = server_command(cfg, served, port, self.key, dtype=dtype, seed=seed,
                                  max_model_len=cfg.max_model_len or max_model_len, on_gpu=on_gpu, index=i,
                                  identity=self.identity, routing=self.routing_replay)
        return Server(i, f"http://{cfg.host}:{port}", self.key, cmd, env,
                      (self.log_dir or self.scratch) / f"server-{i}.log",
                      cfg.request_timeout_s)

    # ---- generation -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: int) -> RolloutBatch:
        copies, n_per_request = (n, 1) if temperature == 0 and n > 1 else (1, n)
        owners = [i for i in range(len(prompts)) for _ in range(copies)]
        bodies = [{"model": MODEL_NAME, "prompt": list(prompts[i]), "n": n_per_request, "temperature": temperature,
                   "top_p": top_p, "max_tokens": max_tokens, "logprobs": 0, "return_token_ids": True,
                   "seed": (seed * 1_000_003 + k * n_per_request) % (2**31),
                   **({"routed_experts_prompt_start": 0} if self.routing_replay else {})}
                  for k, i in enumerate(owners)]
        start = time.perf_counter()
        answers = self._run("/v1/completions", bodies)
        batch = RolloutBatch([], [], [], [], time.perf_counter() - start,
                             routed_experts=[] if self.routing_replay else None)
        for i, answer in zip(owners, answers):
            for c in sorted(answer["choices"], key=lambda c: c["index"]):
                if self.routing_replay:
                    batch.routed_experts.append(checked(c.get("routed_experts"), len(prompts[i]) + len(c["token_ids"]),
                                                        NAME))
                batch.prompt_index.append(i)
                batch.response_ids.append(list(c["token_ids"]))
                batch.rollout_logprobs.append(list(c["logprobs"]["token_logprobs"]))
                batch.finish_reasons.append("stop" if c["finish_reason"] == "stop" else "length")
        batch.meta["resubmitted"] = self._resubmitted
        return batch

    def score(self, sequences: Sequence[Sequence[int]], server: Optional[int] = None) -> list[list[float]]:
        """The verify probe's logprobs; `server`: ask that one (the sync checks each), else any live one."""
        bodies = [{"model": MODEL_NAME, "prompt": list(s), "max_tokens": 1, "temperature": 0.0,
                   "prompt_logprobs": 0, "return_token_ids": True} for s in sequences]
        if server is not None:
            answers = [self.servers[server].post("/v1/completions", b) for b in bodies]
        else:
            answers = self._run("/v1/completions", bodies)
        return [[_prompt_logprob(entry, t) for entry, t in zip(a["choices"][0]["prompt_logprobs"][1:], s[1:])]
                for a, s in zip(answers, sequences)]

    def _run(self, path: str, bodies: list[dict]) -> list[Any]:
        """Every body posted once to some live server, at most max_concurrency in flight per server; answers in
        order. A request whose server dies goes to another (after the dead one is restarted or dropped)."""
        self._resubmitted = 0
        answers: list[Any] = [None] * len(bodies)

        def one(k: int) -> None:
            while True:
                with self.changed:
                    while not self.live and self.restarting:  # wait for a server to come back
                        self.changed.wait()
                    if not self.live:
                        raise RuntimeError(f"{NAME}: every server has died; the step cannot finish")
                    server = self.live[k % len(self.live)]
                try:
                    answers[k] = server.post(path, bodies[k])
                    return
                except ServerDied:
                    self._recover(server)
                    with self.lock:
                        self._resubmitted += 1

        workers = max(1, len(self.live) * self.cfg.max_concurrency)
        with ThreadPoolExecutor(min(workers, len(bodies)) or 1) as pool:
            for f in [pool.submit(one, k) for k in range(len(bodies))]:
                f.result()
        return answers

    def _recover(self, server: Server) -> None:
        """Restart `server` (once, whichever request noticed first) and replay the current weights into it, or
        drop it when restarts are off or used up."""
        with self.changed:
            if server not in self.live:
                return  # another request already dealt with it
            self.live.remove(server)
            restart = server.command is not None and self.cfg.restart_failed \
                and server.restarts < self.cfg.max_restarts
            self.restarting += restart
        log.warning("%s: server %d (%s) died%s; the last lines of its log:\n%s", NAME, server.index, server.url,
                    ", restarting it" if restart else ", dropped", server.tail())
        if not restart:
            return
        try:
            server.stop()
            server.restarts += 1
            server.start(self.cfg.startup_timeout_s)
            for replay in self.on_restart:
                replay(server)
            with self.changed:
                self.live.append(server)
        finally:
            with self.changed:
                self.restarting -= 1
                self.changed.notify_all()

    # ---- what the sync drives ---------------------------------------------------------------------------------

    def weight_receivers(self) -> list[Server]:
        return list(self.live)

    def retire(self, server: Server, why: str) -> str:
        """Take an attached server that a failed push left in an unknown state out of this run's use (it stays
        paused, so no client samples from it); the line that says so."""
        with self.changed:
            if server in self.live:
                self.live.remove(server)
            self.changed.notify_all()
        line = (f"server {server.index} ({server.url}) {why}: taken out of this run's use and left paused for "
                "every client; restart it, or POST /resume with the key if you know its weights are sound")
        log.warning("%s: %s", NAME, line)
        return line

    def sleep(self) -> None:
        pass  # separate servers: the trainer's memory is not theirs

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        servers, self.servers = getattr(self, "servers", []), []
        try:
            with ThreadPoolExecutor(max(1, len(servers))) as pool:
                list(pool.map(lambda s: s.stop(), servers))
        finally:
            if hasattr(self, "_remove_scratch"):
                self._remove_scratch()


def _prompt_logprob(entry: dict, token: int) -> float:
    """The logprob of `token` in one position of a completion's prompt_logprobs ({token id: {logprob: ...}})."""
    item = entry[str(token)]
    return item["logprob"] if isinstance(item, dict) else float(item)
