"""For the benchmarks only: the experts an in-process vLLM engine routed each token to, where vLLM cannot return them
itself (vLLM 0.32 returns routed experts only from its Model Runner V2, which needs Triton; not on these CPUs).

vLLM's own capture binds a callback to every MoE layer's router (`BaseRouter.set_capture_fn`, which the router calls
with the top-k ids it computed, before any expert-parallel remapping); this binds one through LLM.apply_model (the
engine runs in this process) and generates one request at a time, so a forward's rows are that request's tokens: the
prompt tokens its prefill computed (the last ones, when the prefix cache held the first), then one per decode step.
Written for vLLM 0.32's fused-MoE router; refused on another version."""

from __future__ import annotations

from functools import partial

VERSION = "0.32."


def bind(llm) -> dict:
    """{layer: [top-k ids of each forward]} filled by every forward of `llm` from now on."""
    import vllm

    if not vllm.__version__.startswith(VERSION):
        raise RuntimeError(f"_vllm_routing was written for vLLM {VERSION}x's BaseRouter.set_capture_fn; this is "
                           f"{vllm.__version__}")
    seen: dict = {}

    def record(layer: int, ids) -> None:
        seen.setdefault(layer, []).append(ids.detach().to("cpu").clone())

    def attach(model) -> int:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        bound = 0
        for module in model.modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                module.router.set_capture_fn(partial(record, module.layer_id))
                bound += 1
        return bound

    if not sum(llm.apply_model(attach)):
        raise RuntimeError("_vllm_routing: no MoE router of this engine takes a capture callback")
    return seen


def generate(engine, seen: dict, prompts, n: int, temperature: float, top_p: float, max_tokens: int, seed: int):
    """engine.generate's batch, one request per sample, with `routed_experts` (-1 where the prefix cache skipped
    prompt tokens)."""
    import torch

    from qarl_cli.rollout.base import RolloutBatch

    out = RolloutBatch([], [], [], [], 0.0, routed_experts=[])
    for i, prompt in enumerate(prompts):
        for j in range(n):
            seen.clear()
            one = engine.generate([prompt], 1, temperature, top_p, max_tokens, seed=seed * 7919 + i * n + j)
            layers = sorted(seen)
            steps = [torch.stack([seen[l][s] for l in layers], 1) for s in range(len(seen[layers[0]]))]
            rows = torch.cat(steps)  # [computed tokens, layers, k]
            total = len(prompt) + len(one.response_ids[0]) - 1
            routed = torch.full((total, len(layers), rows.shape[-1]), -1, dtype=torch.int16)
            routed[total - min(len(rows), total):] = rows[-total:].to(torch.int16)
            out.prompt_index.append(i)
            out.response_ids += one.response_ids
            out.rollout_logprobs += one.rollout_logprobs
            out.finish_reasons += one.finish_reasons
            out.routed_experts.append(routed)
            out.seconds += one.seconds
    return out
