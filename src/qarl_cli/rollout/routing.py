"""Routing replay on the vLLM engines (qarl_cli.forward.routing): whether this vLLM can return the experts it routed
each token to, and the routing it returns, checked. vLLM 0.32 returns them with `enable_return_routed_experts`
(`--enable-return-routed-experts` for a server) from its Model Runner V2 only: per completion, [prompt + response - 1,
layers, top_k] from prompt token `routed_experts_prompt_start` (0 here) on; a server sends them base64 .npy in
/v1/completions' `routed_experts`."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Optional

from qarl_cli.config.errors import UserError

# what a process running vLLM needs for the capture (the aux-output connector refuses the V1 model runner)
ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def routing_unavailable() -> Optional[str]:
    """Why this vLLM cannot return routed experts here (None: it can). vLLM 0.32 captures them only in its Model
    Runner V2 (vllm/config/vllm.py: the aux-output connector requires it), which refuses to start without Triton."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return ("vLLM returns routed experts only from its Model Runner V2, which needs Triton, and Triton has no "
                "backend on this device")
    return None


def resolve_routing(cfg: Any, model_dir: Path, engine: str) -> tuple[bool, Optional[str]]:
    """(routing replay on, the one-line note when it was asked for by default but is off): rollout.routing_replay
    for this model (qarl_cli.forward.routing.wanted), refused in one line when set true where vLLM cannot honour it."""
    from qarl_cli.machine.capabilities import checkpoint_is_moe
    from qarl_cli.forward.routing import wanted

    on = wanted(cfg.routing_replay, checkpoint_is_moe(model_dir), str(model_dir))
    why = routing_unavailable() if on else None
    if why and cfg.routing_replay:
        raise UserError(f"rollout.routing_replay=true: {why}; use rollout=torch, or leave routing_replay null")
    return (False, f"routing replay off under {engine}: {why}") if why else (on, None)


def checked(experts: Any, tokens: int, engine: str) -> Any:
    """One completion's routing (a numpy array, or a server's base64 .npy string) of a sequence of `tokens` prompt +
    response tokens, as an int16 tensor [tokens - 1, layers, top_k]."""
    import numpy as np
    import torch

    if isinstance(experts, str):
        experts = np.load(io.BytesIO(base64.b64decode(experts)), allow_pickle=False)
    if experts is None or experts.ndim != 3 or experts.shape[0] != tokens - 1:
        raise RuntimeError(f"{engine}: routed experts for {tokens - 1} tokens expected, vLLM returned "
                           f"{None if experts is None else experts.shape} (a server must run with "
                           "--enable-return-routed-experts: rollout.routing_replay on, or set it false)")
    return torch.from_numpy(np.asarray(experts, dtype=np.int16))
