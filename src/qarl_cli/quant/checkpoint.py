"""A model's low-bit state in the scheme's vLLM checkpoint format, and `qarl quantize`'s checkpoint writer.

`quantized_state` yields (name, tensor) exactly as a vLLM checkpoint holds them (int8 + weight_scale;
e4m3 + weight_scale_inv; weight_packed + weight_scale + weight_shape), from an in-memory model or from
checkpoint tensors, so the rollout sync can push the same tensors into a running engine without the engine
quantizing anything. `write_checkpoint` streams a checkpoint through it shard by shard (one input shard and its
output in memory at a time) into a hidden temporary directory that is renamed into place only when complete."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
from torch import nn

from qarl_cli.config.errors import ConfigError, UserError
from qarl_cli.quant.base import CachedWq, Scheme
from qarl_cli.quant.select import CheckpointPlan, checkpoint_plan, checkpoint_state
from qarl_cli.models.safetensors_files import INDEX, SINGLE, open_safetensors, read_tensors
from qarl_cli.machine.disk import disk_full

# Files that hold weights (of any framework); a checkpoint's other files are its side files.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")

State = Union[nn.Module, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def quantized_state(state: State, scheme: Scheme, plan: Optional[CheckpointPlan] = None,
                    amax: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the scheme's vLLM checkpoint format: the planned weights quantized, the rest as given.
    `state`: a model (checkpoint names, plan from its structure and scheme.cfg.ignore; the linears of an aligned
    forward with this scheme give their cached Wq) or checkpoint-named tensors (a mapping or pairs; then `plan`
    is required). `amax`: for a scheme whose fused matrices share a scale, each group's amax (`fused_amax`)."""
    cached: dict[str, CachedWq] = {}
    if isinstance(state, nn.Module):
        plan = plan or plan_for(state, scheme)
        cached = {f"{n}.weight": m for n, m in state.named_modules()
                  if isinstance(m, CachedWq) and _same_scheme(m.scheme, scheme)}
        state = checkpoint_state(state)
    elif plan is None:
        raise ValueError("quantized_state of checkpoint tensors needs their plan (plan_for)")
    items = state.items() if isinstance(state, Mapping) else state
    with torch.no_grad():
        for name, tensor, group_amax in _with_group_amax(items, scheme, plan, amax):
            prefix = name.removesuffix(".weight")
            if name in cached:  # an aligned forward's Wq, already computed for this step: not quantized again
                yield from scheme.packed_tensors(prefix, cached[name].packed(), tuple(tensor.shape))
            elif group_amax is not None:
                yield from scheme.packed_tensors(prefix, scheme.quantize(tensor, amax=group_amax), tuple(tensor.shape))
            elif name in plan.quantized:
                yield from scheme.checkpoint_tensors(prefix, tensor)
            else:
                yield name, tensor


def _with_group_amax(items: Iterable[tuple[str, torch.Tensor]], scheme: Scheme, plan: CheckpointPlan,
                     amax: Optional[dict]) -> Iterator[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
    """(name, tensor, the amax of its fused group): for a scheme whose fused matrices share a scale (nvfp4's
    `fused_group`), each planned tensor with its group's amax, from `amax` (group -> amax) or else from the
    tensors themselves, a group's held back until all of them came; None for everything else."""
    group_of = getattr(scheme, "fused_group", None)
    members: dict[str, set] = {}
    for name in plan.quantized if group_of else ():
        members.setdefault(group_of(name.removesuffix(".weight")), set()).add(name)
    held: dict[str, dict] = {}
    for name, tensor in items:
        if group_of is None or name not in plan.quantized:
            yield name, tensor, None
            continue
        group = group_of(name.removesuffix(".weight"))
        if amax is not None:
            yield name, tensor, amax[group]
            continue
        held.setdefault(group, {})[name] = tensor
        if held[group].keys() == members[group]:
            tensors = held.pop(group)
            top = torch.stack([t.detach().float().abs().amax() for t in tensors.values()]).amax()
            yield from ((n, t, top) for n, t in tensors.items())
    if held:
        raise ValueError(f"quantized_state: {sorted(next(iter(held.values())))[0]} came without the matrices it "
                         f"shares a global scale with ({scheme.name})")


def fused_amax(src: Path, files: list[str], names: dict, plan: CheckpointPlan, scheme: Scheme) -> Optional[dict]:
    """group -> amax over a checkpoint's shards, for a scheme whose fused matrices share a scale (None for the
    others): read once before the shards are written, since a group may straddle two shards."""
    group_of = getattr(scheme, "fused_group", None)
    if group_of is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for file in files:
        keys = [k for k in names[file] if k in plan.quantized]
        for key, t in read_tensors(src / file, keys, what=f"model.path={str(src)!r}, {file}"):
            group, top = group_of(key.removesuffix(".weight")), t.float().abs().amax()
            out[group] = torch.maximum(out[group], top) if group in out else top
    return out


def _same_scheme(a: Scheme, b: Scheme) -> bool:
    return a is b or (type(a) is type(b) and a.cfg == b.cfg
                      and getattr(a, "weight_qmax", None) == getattr(b, "weight_qmax", None))


def plan_for(model: nn.Module, scheme: Scheme) -> CheckpointPlan:
    """What `scheme` quantizes in `model`'s checkpoint (nothing for quant=none)."""
    if not scheme.quantizes_weights:
        return CheckpointPlan(frozenset(), ())
    return checkpoint_plan(model, scheme.cfg.ignore)


def quantization_config(scheme: Scheme, plan: CheckpointPlan) -> Optional[dict]:
    """config.json's `quantization_config` for a checkpoint written with `plan`."""
    return scheme.quantization_config(list(plan.kept))


def load_meta_model(src: Path, trust_remote_code: bool = False) -> nn.Module:
    """The checkpoint's model on the meta device (structure and names only), or ConfigError if `src` is not an
    unquantized causal-LM checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = f"model.path={str(src)!r}"
    try:
        config = AutoConfig.from_pretrained(str(src), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any unreadable config is the same user error
        raise ConfigError(f"{where}: not a Hugging Face checkpoint ({str(e).splitlines()[0]})") from None
    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in archs):
        raise ConfigError(f"{where}: not a causal-LM checkpoint (architectures={archs})")
    if getattr(config, "quantization_config", None):
        raise ConfigError(f"{where}: already quantized (config.json has a quantization_config)")
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise ConfigError(f"{where}: not a causal-LM checkpoint ({str(e).splitlines()[0]})") from None


def shard_files(src: Path) -> list[str]:
    if (src / INDEX).is_file():
        return sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
    if (src / SINGLE).is_file():
        return [SINGLE]
    raise ConfigError(f"model.path={str(src)!r}: no safetensors weights ({SINGLE} or {INDEX})")


def check_out(out: Path, src: Path, overwrite: bool) -> None:
    """Before anything is read or written: `out` apart from the input (replacing a directory that holds the input
    would delete it), and, to be replaced, a checkpoint directory itself."""
    from qarl_cli.machine.disk import refuse_overlap, replaceable

    refuse_overlap("out", out, [("model.path", src)], "the output must be a directory of its own, apart from "
                   "the checkpoint it is made from")
    if overwrite:
        replaceable("out", out)


def write_checkpoint(src: Path, out: Path, scheme: Scheme, overwrite: bool = False, progress: bool = True,
                     trust_remote_code: bool = False) -> dict:
    """Write `src` quantized with `scheme` to `out` (config, tokenizer, generation config and other files
    copied); returns a summary. `out` appears only when complete."""
    from rich.progress import Progress
    from safetensors.torch import save_file

    from qarl_cli.machine import scratch

    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise ConfigError(f"out={str(out)!r} already exists; pass overwrite=true to replace it")
    check_out(out, src, overwrite)
    start = time.time()
    plan = plan_for(load_meta_model(src, trust_remote_code), scheme)
    files = shard_files(src)
    scratch.sweep(out.parent, f".{out.name}.old-")  # what a killed writer left: removed if its process is dead
    tmp: Optional[Path] = None
    weight_map: dict[str, str] = {}
    done: set[str] = set()
    nbytes = 0
    try:
        tmp = scratch.make(out.parent, f".{out.name}.tmp-")
        names = {f: _keys(src / f) for f in files}
        amax = fused_amax(src, files, names, plan, scheme)
        with Progress(disable=not progress) as bar:
            task = bar.add_task(f"quantize {scheme.name}", total=sum(map(len, names.values())))
            for file in files:
                shard = _read_shard(src, file, names[file], done, lambda: bar.advance(task))
                tensors = dict(quantized_state(shard, scheme, plan, amax))
                save_file(tensors, str(tmp / file), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, file))
                nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
                del tensors
        missing = sorted(plan.quantized - done)
        if missing:
            raise ConfigError(f"model.path={str(src)!r}: the checkpoint lacks {len(missing)} of the weights to "
                              f"quantize (e.g. {missing[0]}); its tensor names are not transformers' names")
        _write_metadata(src, tmp, scheme, plan, weight_map, nbytes)
        try:  # the existence check holds at the rename: a writer that finished first into `out` keeps it
            scratch.publish(tmp, out, replace=overwrite)
        except FileExistsError:
            raise ConfigError(f"out={str(out)!r} was created by another writer while this one ran; it is kept as "
                              "that writer left it and nothing was written (overwrite=true replaces it)") from None
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(e):
            raise UserError(f"out={str(out)!r}: no space left on its file system while writing the checkpoint "
                            f"({_first_line(e)}); nothing was written (the input's weights: {_size(src)} MiB)"
                            ) from None
        raise
    return {"scheme": scheme.name, "out": str(out), "quantized": len(plan.quantized), "kept": list(plan.kept),
            "shards": len(files), "weights_bytes": nbytes, "seconds": round(time.time() - start, 1)}


def _keys(path: Path) -> list[str]:
    with open_safetensors(path) as reader:  # a missing, truncated or damaged shard: one line naming it
        return list(reader.keys())


def _read_shard(src: Path, file: str, keys: list[str], seen: set[str], advance: Callable[[], None]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """One shard's tensors, one at a time, each checked to be finite (NaN/inf: one line naming it)."""
    for key, tensor in read_tensors(src / file, keys, what=f"model.path={str(src)!r}, {file}"):
        seen.add(key)
        yield key, tensor
        advance()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _size(src: Path) -> int:
    return max(1, round(sum(p.stat().st_size for p in src.glob("*.safetensors")) / 2**20))


def _write_metadata(src: Path, tmp: Path, scheme: Scheme, plan: CheckpointPlan, weight_map: dict[str, str],
                    nbytes: int) -> None:
    config = json.loads((src / "config.json").read_text())
    block = quantization_config(scheme, plan)
    if block is not None:
        config["quantization_config"] = block
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / INDEX).is_file():
        index = {"metadata": {"total_size": nbytes}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    copy_side_files(src, tmp)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the side files of checkpoint `src` (tokenizer, chat template, generation config, ...) into `dst`:
    every plain file that holds no weights, is not the shard index and is not hidden, unless `dst` has it
    already (what the writer of `dst` wrote, its config.json included, is kept). Returns the names copied."""
    src, dst, copied = Path(src), Path(dst), []
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.startswith(".") and path.name != INDEX \
                and not path.name.endswith(WEIGHT_SUFFIXES) and not (dst / path.name).exists():
            shutil.copy2(path, dst / path.name)
            copied.append(path.name)
    return copied
