"""rollout=torch: an embedded engine in plain PyTorch. It runs the model with the very modules of the aligned
forward (quant/aligned.py), so on the same weights its logprobs are the trainer's up to float rounding that
differs with the batch layout (which int8's activation rounding can turn into a few 1e-3 in a logprob, now and
then, below float64), and it needs nothing beyond transformers: the engine of CPU runs and tests, and the
reference the vLLM engine is compared with.

Sampling is batched with a KV cache (transformers' DynamicCache): prompts are left-padded, positions come from
the attention mask, and finished sequences leave the batch. Weights arrive in checkpoint format; prequantized
ones are served exactly as sent (the packed tensors dequantized into the aligned modules' caches), online ones
are copied into the masters and quantized by the aligned modules."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from qarl_cli.config.stages import TorchRolloutConfig
from qarl_cli.machine.capabilities import checkpoint_is_moe
from qarl_cli.forward.logprobs import sequence_logprobs
from qarl_cli.forward.routing import Recorder, wanted
from qarl_cli.forward.aligned import AlignedExperts, AlignedLinear, align, refresh
from qarl_cli.quant.base import resolve_device
from qarl_cli.quant.checkpoint import plan_for, quantized_state
from qarl_cli.quant.select import checkpoint_state, is_fused_experts
from qarl_cli.rollout.base import RolloutBatch, WeightSyncError, stop_ids
from qarl_cli.rollout.weights import checked, spec_of

ENGINE = "rollout=torch"
# A fused experts module's matrices under their checkpoint names (select.py): `{experts}.{e}.{proj}.weight`.
_EXPERT = re.compile(r"(.+)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class TorchEngine:
    name = "torch"

    def __init__(self, cfg: TorchRolloutConfig, model_dir: Path, scheme, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: Optional[int] = None,
                 device: str = "auto", workdir: Optional[Path] = None, log_dir: Optional[Path] = None) -> None:
        """seed: unused, every generate call is seeded on its own. max_model_len: unused, the cache grows as
        needed. workdir: unused, nothing is written."""
        from transformers import AutoModelForCausalLM

        self.cfg, self.scheme = cfg, scheme
        self.device = torch.device(resolve_device(device))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        self.eos = stop_ids(model.generation_config.eos_token_id)
        # What the engine accepts, from a twin on the meta device (no weight is copied or quantized).
        with torch.device("meta"):
            twin = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
        state = checkpoint_state(twin)
        plan = plan_for(twin, scheme)
        # The tensors a push may hold, per sync.mode: prequantized, the packed low-bit ones and scales; online,
        # every tensor unquantized, as the trainer holds it.
        self.specs = {"prequantized": spec_of(quantized_state(state, scheme, plan)),
                      "online": spec_of(state.items())}
        # name of each packed tensor -> the matrix (checkpoint prefix) it belongs to; the rest are plain tensors.
        self._owner = {}
        for name in self.specs["prequantized"]:
            owner = name.rsplit(".", 1)[0]
            if f"{owner}.weight" in plan.quantized and (name not in state or name in plan.quantized):
                self._owner[name] = owner
        model.requires_grad_(False)
        self.model = align(model.to(self.device), scheme).eval()
        self._modules = dict(self.model.named_modules())
        params = dict(self.model.named_parameters(remove_duplicate=False))
        self._dest = {n: self._destination(n, params) for n in state}  # where an unquantized tensor goes
        self._parts: dict[str, list[str]] = {}
        for name, owner in self._owner.items():
            self._parts.setdefault(owner, []).append(name)
        self._aligned = {owner: self._aligned_module(owner) for owner in self._parts}
        # routing replay: the experts every forward routed each token to, recorded by hooks on the routers
        self.routing_replay = wanted(cfg.routing_replay, checkpoint_is_moe(model_dir), str(model_dir))
        self._recorder = Recorder(self.model) if self.routing_replay else None
        # low-bit formats without a kernel here (fp4, integer weights): the aligned modules dequantize the values
        # and multiply in the model's dtype, which is the scheme's arithmetic, not its speed
        self.emulation_note = None
        if getattr(scheme, "emulated", None):
            self.emulation_note = (f"{ENGINE}: quant={scheme.name} emulated in PyTorch ({scheme.emulated}, "
                                   f"GEMMs in {dtype})")

    def _destination(self, name: str, params: dict) -> tuple[torch.nn.Parameter, tuple]:
        """The parameter (and the index into it) that a plain checkpoint tensor is copied into: itself, or its
        slice of a fused experts matrix (gate_up_proj [E, 2I, H] holds gate rows then up rows)."""
        if name in params:
            return params[name], (...,)
        experts, e, proj = self._expert(name, is_fused_experts)
        if proj == "down_proj":
            return experts.down_proj, (e,)
        half = experts.gate_up_proj.shape[1] // 2
        return experts.gate_up_proj, (e, slice(0, half) if proj == "gate_proj" else slice(half, 2 * half))

    def _aligned_module(self, owner: str) -> tuple:
        """(module, expert, projection) serving a quantized matrix: an AlignedLinear, or one expert matrix of an
        AlignedExperts."""
        if isinstance(self._modules.get(owner), AlignedLinear):
            return self._modules[owner], None, None
        return self._expert(f"{owner}.weight", lambda m: isinstance(m, AlignedExperts))

    def _expert(self, name: str, fits) -> tuple:
        match = _EXPERT.fullmatch(name)
        module = self._modules.get(match.group(1)) if match else None
        if module is None or not fits(module):
            raise ValueError(f"{ENGINE}: no module serves checkpoint tensor {name!r}")
        return module, int(match.group(2)), match.group(3)

    # ---- sampling --------------------------------------------------------------------------------------------

    @torch.no_grad()  # not inference_mode: the aligned caches built here are written in place by load_weights
    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: int) -> RolloutBatch:
        start = time.time()
        index = [i for i in range(len(prompts)) for _ in range(n)]
        gen = torch.Generator(self.device).manual_seed(seed)
        response_ids, logprobs, reasons, routed = [], [], [], []
        for lo in range(0, len(index), self.cfg.batch_size):
            chunk = [prompts[i] for i in index[lo:lo + self.cfg.batch_size]]
            ids, lps, why, routes = self._sample(chunk, temperature, top_p, max_tokens, gen)
            response_ids += ids
            logprobs += lps
            reasons += why
            routed += routes
        return RolloutBatch(index, response_ids, logprobs, reasons, seconds=time.time() - start,
                            routed_experts=routed if self._recorder else None)

    def _sample(self, prompts: list, temperature: float, top_p: float, max_tokens: int,
                gen: torch.Generator) -> tuple[list, list, list, list]:
        from transformers import DynamicCache

        ids, mask = self._left_pad(prompts)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        # per row, the routing of each token it ran (prompt from position 0, then each sampled token fed back)
        routes: list[list[torch.Tensor]] = [[] for _ in prompts]
        if self._recorder:
            taken = self._recorder.take().view(*ids.shape, -1, self._recorder.pairs[0][1].top_k)
            for row, p in enumerate(prompts):
                routes[row].append(taken[row, ids.shape[1] - len(p):])
        position = mask.sum(-1)  # of the next token: the prompt's real length
        live = list(range(len(prompts)))  # the rows still sampling, in the cache's batch order
        responses: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        reasons = ["length"] * len(prompts)
        for step in range(max_tokens):
            logits = logits.float()
            token = self._pick(logits, temperature, top_p, gen)
            # raw logprob of the sampled token, before temperature and top-p (vLLM's raw_logprobs)
            logp = torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0]
            for row, t, lp in zip(live, token.tolist(), logp.tolist()):
                responses[row].append(t)
                logprobs[row].append(lp)
                if t in self.eos:
                    reasons[row] = "stop"
            keep = [i for i, row in enumerate(live) if reasons[row] != "stop"]
            if not keep or step == max_tokens - 1:
                break
            if len(keep) < len(live):  # finished sequences leave the batch (and the cache)
                rows = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(rows)
                token, mask, position = token[rows], mask[rows], position[rows]
                live = [live[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], -1)
            logits = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
                                past_key_values=cache, use_cache=True).logits[:, -1]
            if self._recorder:
                taken = self._recorder.take()
                for i, row in enumerate(live):
                    routes[row].append(taken[i:i + 1])
            position = position + 1
        return responses, logprobs, reasons, [torch.cat(r) for r in routes] if self._recorder else []

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / temperature, -1)
        if top_p < 1:
            # nucleus: keep the most likely tokens until their mass reaches top_p (the first one always)
            top, order = probs.sort(dim=-1, descending=True, stable=True)
            top = top.masked_fill(top.cumsum(-1) - top >= top_p, 0)
            probs = torch.zeros_like(probs).scatter_(-1, order, top)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    def _left_pad(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask, left-padded with token 0, which the mask hides."""
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            cols = slice(width - len(s), width)
            ids[i, cols] = torch.tensor(list(s), dtype=torch.long)
            mask[i, cols] = 1
        return ids.to(self.device), mask.to(self.device)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return sequence_logprobs(self.model, sequences, batch_size=self.cfg.batch_size)

    # ---- weights ---------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], mode: str = "prequantized") -> None:
        if mode not in self.specs:
            raise ValueError(f"{ENGINE}: weights in format {mode!r}; this engine takes {', '.join(self.specs)}")
        items = checked(weights, self.specs[mode], ENGINE)
        plain, packed = [], {}
        for name, tensor in items:
            if mode == "prequantized" and name in self._owner:
                packed.setdefault(self._owner[name], {})[name.rsplit(".", 1)[1]] = tensor
            else:
                plain.append((name, tensor))
        for owner, parts in packed.items():  # a matrix is dequantized from all its parts: they come together
            missing = [n for n in self._parts[owner] if n.rsplit(".", 1)[1] not in parts]
            if missing:
                raise WeightSyncError(f"{ENGINE}: weight {missing[0]!r} is missing (the tensors of {owner!r} come "
                                      "together); the engine kept its old weights")
        with torch.no_grad():
            for name, tensor in plain:
                param, at = self._dest[name]
                param[at].copy_(tensor)
            for owner, parts in packed.items():
                self._load_packed(owner, {k: t.to(self.device) for k, t in parts.items()})
        if mode == "online":
            refresh(self.model)  # the aligned modules quantize the new masters at the next forward

    def _load_packed(self, owner: str, packed: dict) -> None:
        """Pin one matrix's sent low-bit weight into its aligned module, without touching the masters (so the
        cached weights of every other module stay valid). The masters keep the checkpoint's weights: a
        `refresh`, or moving the model to another device, would serve those again."""
        module, e, proj = self._aligned[owner]
        if e is None:
            w_dq = self.scheme.dequantize(packed, module.weight.dtype)
            module.load_quantized((packed, w_dq))
            return
        gate_up, down = module.quantized()  # the served weights; only this expert matrix changes
        half = gate_up.shape[1] // 2
        target = {"gate_proj": gate_up[e, :half], "up_proj": gate_up[e, half:], "down_proj": down[e]}[proj]
        target.copy_(self.scheme.dequantize(packed, gate_up.dtype))
        module.load_quantized((gate_up, down))

    def sleep(self) -> None:  # its memory is the trainer's own modules' (rollout=torch shares them)
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        if self._recorder:
            self._recorder.close()
        self.model = self._modules = self._dest = self._aligned = None  # the last references to the weights
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
