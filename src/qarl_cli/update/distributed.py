"""Data-parallel training under torchrun (`torchrun --nproc-per-node N --no-python qarl train ...`).

FSDP2 (`fully_shard`, one unit per decoder layer plus the root) shards the policy, its gradients and the optimizer
state over the ranks: gloo on CPU, NCCL on GPU. Rank 0 alone runs the rollout engine, the reward and the loggers;
what they return is broadcast, so every rank builds the same batch. Each rank forwards and backpropagates its share
of every minibatch with its loss weighted by its share of the minibatch's denominator (objectives.DENOMINATORS);
FSDP averages the gradients over the ranks, which makes them the one-process minibatch gradient. The checkpoints
gather the full weights on rank 0; the weight sync streams them there one decoder layer at a time
(`model_state_stream`), so rank 0 never holds more than a layer's full weights besides its bucket.

Outside torchrun (WORLD_SIZE unset or 1) `Single` stands in: the same calls, no communication, nothing changed."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from qarl_cli.config.errors import UserError


def layer_groups(names: list[str]) -> list[list[str]]:
    """The state dict's names grouped for a streamed gather: all of one decoder layer (`...layers.N.`) together,
    every other name alone, in the order of their first appearance."""
    groups: dict[str, list[str]] = {}
    for name in names:
        m = re.match(r"(.*?\blayers\.\d+)\.", name)
        groups.setdefault(m.group(1) if m else name, []).append(name)
    return list(groups.values())


class RankFailed(UserError, RuntimeError):
    """Rank 0 raised in a stage only it runs; the other ranks stop with its message."""


class Single:
    """One process: every collective is the identity."""

    rank, world, main = 0, 1, True

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_sum(self, t: Tensor) -> Tensor:
        return t

    def share(self, rows: Tensor) -> tuple[Tensor, bool]:
        """This rank's rows of a minibatch, and whether they are real (False: a stand-in row weighted 0, so that
        a rank without rows still joins the collective forward and backward)."""
        return rows, True

    def main_only(self, fn: Callable[[], Any], send: bool = True) -> Any:
        """Run `fn` on rank 0; every rank gets its result (send=False: only rank 0, the others None). An
        exception on rank 0 is raised on every rank, so none waits forever for a broadcast that never comes."""
        return fn()

    def shard(self, model: nn.Module) -> nn.Module:
        return model

    def model_state(self, model: nn.Module) -> Optional[dict]:
        """The full state dict (rank 0; {} on the others), or None where the model holds it unsharded."""
        return None

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def close(self) -> None:
        pass


class Distributed(Single):
    def __init__(self, device_type: str) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.dist = dist
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
            else torch.device("cpu")
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.main = self.rank == 0
        self.mesh = init_device_mesh(device_type, (self.world,))

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def all_sum(self, t: Tensor) -> Tensor:
        out = t.detach().to(self.device, copy=True)
        self.dist.all_reduce(out)
        return out.to(t.device)

    def share(self, rows: Tensor) -> tuple[Tensor, bool]:
        mine = rows[self.rank::self.world]
        return (mine, True) if len(mine) else (rows[:1], False)

    def main_only(self, fn: Callable[[], Any], send: bool = True) -> Any:
        if self.main:
            try:
                out = fn()
            except BaseException as e:
                self.broadcast(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
                raise
            self.broadcast(("ok", out if send else None))
            return out
        status, out = self.broadcast(None)
        if status == "error":
            raise RankFailed(f"rank 0 failed ({out})")
        return out

    def shard(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from qarl_cli.forward.aligned import keep_cache

        keep_cache(model, False)  # a cache of whole Wq would outlive FSDP's reshard: more than the rank's shard
        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        if not layers:
            raise UserError(f"FSDP: no decoder layers found in {type(model).__name__} (looked for *DecoderLayer)")
        for layer in layers:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        return model

    def model_state(self, model: nn.Module) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def model_state_stream(self, model: nn.Module, convert: Callable[[dict], dict]
                           ) -> Iterator[tuple[str, Tensor]]:
        """The full weights one layer group at a time (layer_groups): every rank takes part in each tensor's
        gather, in the same order; rank 0 yields the items of `convert(group)` (to checkpoint names), the others
        nothing, and each must be read to its end on every rank, or the ranks fall out of step."""
        from torch.distributed.tensor import DTensor

        state = model.state_dict()  # FSDP2: the local shards as DTensors; nothing is gathered yet
        for names in layer_groups(list(state)):
            full = {}
            for name in names:
                t = state[name]
                full[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
            if self.main:
                yield from convert(full).items()

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.barrier()
            self.dist.destroy_process_group()


def from_env(device_type: str) -> Single:
    """Distributed under torchrun with WORLD_SIZE > 1, else Single."""
    return Distributed(device_type) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else Single()


def chunks_per_rank(n: int, world: int, chunk: int) -> int:
    """How many chunks of `chunk` rows each rank runs so that all run the same number of collective forwards."""
    return max(1, math.ceil(math.ceil(n / world) / chunk))


def rank_chunks(dist: Any, rows: Any, chunk: int) -> Iterator[tuple[Any, bool]]:
    """This rank's share of `rows` in chunks of `chunk`, as (rows, used) pairs, the same number on every rank so
    that FSDP's collective forwards pair up. A rank whose share has run out still runs a forward, on a stand-in
    row with used=False: its result must carry no weight."""
    mine, real = dist.share(rows)
    for i in range(chunks_per_rank(len(rows), dist.world, chunk)):
        part = mine[i * chunk:(i + 1) * chunk] if real else mine
        yield (part, real) if len(part) else (mine[:1], False)


class MainEngine:
    """Rank 0's rollout engine as every rank sees it: rank 0 runs it, the others get what it returns."""

    def __init__(self, dist: Single, engine: Any) -> None:
        self.dist, self.engine = dist, engine

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.dist.main_only(lambda: self.engine.generate(*args, **kwargs))

    def score(self, sequences: Any) -> Any:
        return self.dist.main_only(lambda: self.engine.score(sequences))

    def load_weights(self, weights: Any, mode: str = "prequantized") -> None:  # the other ranks' are empty
        self.dist.main_only(lambda: self.engine.load_weights(weights, mode), send=False)

    def deliver(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on rank 0 (the sync's delivery of the gathered weights); rank 0 gets its result, the others
        None; an error on rank 0 is raised on every rank."""
        return self.dist.main_only(lambda: fn(self.engine), send=False)

    def sleep(self) -> None:
        self.dist.main_only(lambda: self.engine.sleep(), send=False)

    def wake_up(self) -> None:
        self.dist.main_only(lambda: self.engine.wake_up(), send=False)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class MainReward:
    """Rank 0's reward workers as every rank sees them."""

    def __init__(self, dist: Single, reward: Any) -> None:
        self.dist, self.reward = dist, reward

    def score(self, completions: list[str], golds: list[str]) -> Any:
        return self.dist.main_only(lambda: self.reward.score(completions, golds))

    def close(self) -> None:
        if self.reward is not None:
            self.reward.close()
