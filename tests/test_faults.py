"""A user's mistakes and a machine's faults, as `qarl` meets them: NaN/inf config values, checkpoints with NaN/inf
weights (written by save, loaded by train, resume, eval and quantize), truncated safetensors files, a full disk
under `qarl quantize`, two `qarl quantize` into the same `out`, and data.test_size that leaves a split empty.
Each ends in one line naming the key or the file, and leaves nothing half-written behind."""

import json
import math
import shutil
import subprocess
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qarl_cli.cli import main
from qarl_cli.config.errors import ConfigError, UserError
from qarl_cli.config.finite import first_nonfinite
from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.quant import SCHEMAS
from qarl_cli.models.integrity import CheckpointError, check_checkpoint, load_model
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme
from qarl_cli.quant.checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random-init tiny model (no warm start: seconds to build)."""
    cache = str(tmp_path_factory.mktemp("models"))
    return ensure_tiny_model(TinyModelConfig(cache_dir=cache, warm_start_steps=0), log=lambda _: None)


def _error_line(capsys):
    """The command's error: the last line it wrote to stderr, which must be its only non-log line."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------- config values

@pytest.mark.parametrize("command, override, key", [
    ("train", "lr=inf", "lr"),  # lr > 0 lets inf through
    ("train", "weight_decay=nan", "weight_decay"),
    ("train", "reward.timeout_s=inf", "reward.timeout_s"),
    ("train", "algorithm.entropy_coef=-inf", "algorithm.entropy_coef"),
    ("train", "grad_clip=inf", "grad_clip"),
    ("eval", "temperature=inf", "temperature"),  # temperature >= 0 lets inf through
])
def test_no_nonfinite_config_value_passes(command, override, key, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([command, override, "model=hf", f"model.path={tmp_path / 'no-model'}"]) == 2
    value = override.split("=", 1)[1]
    assert _error_line(capsys) == f"qarl {command}: error: {key}={float(value)!r}: must be a finite number (not nan " \
                                  "or inf)"
    assert not (tmp_path / "outputs").exists()  # refused before anything ran


def test_the_walk_reaches_lists_nesting_and_a_schema_s_declared_infinities():
    @dataclass
    class Inner:
        cap: float = 2.0
        allow_inf: ClassVar[tuple[str, ...]] = ("cap",)  # +inf means "no cap" here, and only here

    @dataclass
    class Outer:
        inner: Inner
        betas: list
        name: str = "inf"  # text, not a number

    assert first_nonfinite(Outer(Inner(math.inf), [0.9, 0.99])) is None
    assert first_nonfinite(Outer(Inner(-math.inf), [0.9, 0.99])) == ("inner.cap", -math.inf)
    key, value = first_nonfinite(Outer(Inner(math.nan), [0.9, 0.99]))
    assert key == "inner.cap" and math.isnan(value)
    assert first_nonfinite(Outer(Inner(), [0.9, math.inf])) == ("betas[1]", math.inf)
    assert first_nonfinite({"a": {"b": [1, 2.5, {"c": math.inf}]}}) == ("a.b[2].c", math.inf)


# -------------------------------------------------------------------------------- non-finite weights

def _poisoned(src, dst, names=2):
    """A copy of checkpoint `src` with NaN written into its first `names` tensors (in file order)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    bad = sorted(tensors)[:names]
    for name in bad:
        tensors[name] = tensors[name].clone().fill_(math.nan)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return bad, sum(t.is_floating_point() for t in tensors.values())


def _learner(model):
    from qarl_cli.update.distributed import Single

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return SimpleNamespace(dist=Single(), optimizer=optimizer, skipped=0,
                           scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))


def test_save_writes_no_checkpoint_of_nonfinite_weights(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from qarl_cli.train import state

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    floating = [n for n, t in model.state_dict().items() if t.is_floating_point()]
    with torch.no_grad():
        model.get_parameter("model.layers.1.mlp.up_proj.weight").fill_(math.inf)
        model.get_parameter("model.layers.2.self_attn.q_proj.weight")[0, 0] = math.nan
    with pytest.raises(CheckpointError) as err:
        state.save(tmp_path, 3, model, _learner(model), tiny, {})
    assert str(err.value).startswith(f"checkpoint {state.checkpoint_dir(tmp_path, 3)} not written: 2 of "
                                     f"{len(floating)} weight tensors hold NaN or inf (first: "
                                     "model.layers.1.mlp.up_proj.weight)")
    assert list(tmp_path.rglob("*")) in ([], [tmp_path / "checkpoints"])  # nothing written


def test_a_checkpoint_with_nonfinite_weights_is_refused_by_every_command(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad, total = _poisoned(tiny, tmp_path / "diverged")
    with pytest.raises(CheckpointError, match=f"diverged: 2 of {total} weight tensors hold NaN or inf "
                                              rf"\(first: {bad[0]}\)"):
        check_checkpoint(tmp_path / "diverged")
    with pytest.raises(CheckpointError, match=f"diverged: 2 of {total} weight tensors hold NaN or inf"):
        load_model(tmp_path / "diverged", dtype=torch.float32)

    assert main(["eval", "model=hf", f"model.path={tmp_path / 'diverged'}", "limit=2"]) == 1
    assert _error_line(capsys).startswith(f"qarl eval: error: {tmp_path / 'diverged'}: 2 of {total} weight "
                                          "tensors hold NaN or inf")
    out = tmp_path / "diverged-int8"
    assert main(["quantize", "model=hf", f"model.path={tmp_path / 'diverged'}", "quant=int8", f"out={out}"]) == 1
    assert f"model.safetensors: weight '{bad[0]}' holds NaN or inf values" in _error_line(capsys)
    assert not out.exists() and not list(tmp_path.glob(".diverged-int8*"))
    train = ["train", "model=hf", "steps=1", "eval_every=0", "prompts_per_step=2", "samples_per_prompt=2"]
    assert main([*train, f"model.path={tmp_path / 'diverged'}"]) == 1
    assert f"{tmp_path / 'diverged'}: 2 of {total} weight tensors hold NaN or inf" in _error_line(capsys)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"  # a resume from a checkpoint whose weights diverged
    ckpt.mkdir(parents=True)
    shutil.copytree(tmp_path / "diverged", ckpt / "model")
    torch.save({"step": 1}, ckpt / "trainer.pt")
    resume = [f if f != "steps=1" else "steps=2" for f in train]  # a step left to train after checkpoint 1
    assert main([*resume, f"model.path={tiny}", f"resume={ckpt}"]) == 1
    assert f"{ckpt / 'model'}: 2 of {total} weight tensors hold NaN or inf" in _error_line(capsys)


# --------------------------------------------------------------------------------- truncated files

def test_a_truncated_safetensors_file_is_named_by_every_command(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cut = tmp_path / "cut"
    shutil.copytree(tiny, cut)
    with open(cut / "model.safetensors", "r+b") as f:  # a copy that stopped half-way
        f.truncate((cut / "model.safetensors").stat().st_size // 2)
    why = f"{cut / 'model.safetensors'}: not a complete safetensors file"
    assert main(["quantize", "model=hf", f"model.path={cut}", "quant=w4a16", f"out={tmp_path / 'q'}"]) == 1
    assert _error_line(capsys).startswith(f"qarl quantize: error: {why}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut", "outputs"]
    assert main(["train", "model=hf", f"model.path={cut}", "steps=1", "eval_every=0"]) == 1
    assert _error_line(capsys).startswith(f"qarl train: error: {why}")
    assert main(["eval", "model=hf", f"model.path={cut}", "limit=2"]) == 1
    assert _error_line(capsys).startswith(f"qarl eval: error: {why}")


# ------------------------------------------------------------------------------------------ full disk

def test_quantize_onto_a_full_disk_says_so_and_leaves_nothing(tiny, tmp_path, monkeypatch, capsys):
    """A real full file system: a 256 KiB tmpfs (mounting needs root; skipped otherwise)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        monkeypatch.chdir(tmp_path)
        out = small / "tiny-int8"
        assert main(["quantize", "model=hf", f"model.path={tiny}", "quant=int8", f"out={out}"]) == 1
        line = _error_line(capsys)
        assert line.startswith(f"qarl quantize: error: out={str(out)!r}: no space left on its file system")
        assert "nothing was written" in line
        assert list(small.iterdir()) == []  # neither the output nor its temporary directory
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_full_disk_is_recognised_in_every_form_the_writers_raise_it(tmp_path):
    from qarl_cli.machine.disk import disk_full

    with pytest.raises(OSError) as err:  # /dev/full: every write fails with ENOSPC
        with open("/dev/full", "w") as f:
            f.write("x")
    assert disk_full(err.value)
    with pytest.raises(RuntimeError) as err:  # torch.save's zip writer on a full device
        torch.save({"w": torch.zeros(4096)}, "/dev/full")
    assert disk_full(err.value), err.value
    assert disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 403712 vs 403664"))
    assert not disk_full(FileNotFoundError(2, "No such file or directory"))
    assert not disk_full(RuntimeError("No space left on device (os error 28)"))  # not an I/O error type


# ------------------------------------------------------------------------- two writers, one output

def _weight_dtype(out):
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        key = next(k for k in f.keys() if k.startswith("model.layers.0.mlp.up_proj.weight"))
        return key.rsplit(".", 1)[1], f.get_tensor(key).dtype


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_writer_that_finishes_second_does_not_silently_replace_the_first(tiny, tmp_path, monkeypatch,
                                                                           overwrite):
    """Two writers start into the same absent `out` (both pass the check at the start); the int8 one finishes
    while the w4a16 one is writing its metadata. The interleaving is forced by running the int8 writer from
    inside the w4a16 writer's last step before its rename; both are the real writer."""
    import qarl_cli.quant.checkpoint as ck

    out, real = tmp_path / "out", ck._write_metadata

    def the_other_writer_finishes_first(*args):
        monkeypatch.setattr(ck, "_write_metadata", real)
        write_checkpoint(tiny, out, build_scheme(SCHEMAS["int8"](), "cpu"), progress=False)
        real(*args)

    monkeypatch.setattr(ck, "_write_metadata", the_other_writer_finishes_first)
    w4a16 = build_scheme(SCHEMAS["w4a16"](), "cpu")
    if overwrite:  # an explicit replace: the last writer's checkpoint, complete, and nothing else
        write_checkpoint(tiny, out, w4a16, overwrite=True, progress=False)
        assert _weight_dtype(out) == ("weight_packed", torch.int32)
    else:
        with pytest.raises(ConfigError, match="was created by another writer while this one ran"):
            write_checkpoint(tiny, out, w4a16, progress=False)
        assert _weight_dtype(out) == ("weight", torch.int8)
        assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_publish_never_replaces_without_being_told(tmp_path):
    from qarl_cli.machine.scratch import publish

    for existing in ("empty-dir", "file"):
        tmp, out = tmp_path / f"tmp-{existing}", tmp_path / existing
        tmp.mkdir()
        (tmp / "a").write_text("new")
        out.mkdir() if existing == "empty-dir" else out.write_text("old")
        with pytest.raises(FileExistsError):
            publish(tmp, out)
        assert (tmp / "a").read_text() == "new" and out.exists() and not (out.is_dir() and list(out.iterdir()))
        publish(tmp, out, replace=True)
        assert (out / "a").read_text() == "new" and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-dir", "file"]


# ----------------------------------------------------------------------------------- data.test_size

@pytest.mark.parametrize("test_size, message", [
    (0, "data.test_size=0: must be >= 1"),  # refused by its domain, before the file is read
    (5, "data.test_size=5: data.path={f} has 5 problems, and holding out 5 for the test split leaves none"),
    (500, "data.test_size=500: data.path={f} has 5 problems, and holding out 5 for the test split leaves none"),
])
def test_train_refuses_a_test_size_that_leaves_a_split_empty(tiny, tmp_path, monkeypatch, capsys, test_size,
                                                             message):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(5)))
    assert main(["train", "model=hf", f"model.path={tiny}", "data=file", f"data.path={data}",
                 f"data.test_size={test_size}", "steps=1", "eval_every=0", "max_new_tokens=16"]) == 2
    assert _error_line(capsys).startswith(f"qarl train: error: {message.format(f=data)}")
