"""Where a resume starts (train.state.find_resume, every form of `resume=`), which files of a checkpoint travel
with it (quant.checkpoint.copy_side_files, used by qarl quantize and by training checkpoints), and the set of
tokens that end a response (rollout.base.stop_ids, used by the torch engine and by decoding)."""

from pathlib import Path

import pytest
import torch

from qarl_cli.config.errors import ConfigError
from qarl_cli.quant.checkpoint import WEIGHT_SUFFIXES, copy_side_files
from qarl_cli.rollout.base import stop_ids
from qarl_cli.train.state import checkpoint_dir, find_resume


def _run_dir(root: Path, steps, incomplete=()) -> Path:
    """A run directory with complete checkpoints at `steps` and ones without trainer.pt at `incomplete`."""
    for step in steps:
        (checkpoint_dir(root, step) / "model").mkdir(parents=True)
        torch.save({"step": step}, checkpoint_dir(root, step) / "trainer.pt")
    for step in incomplete:
        (checkpoint_dir(root, step) / "model").mkdir(parents=True)
    return root


@pytest.mark.parametrize("off", [None, "", "false", "False"])
def test_resume_off_starts_fresh(tmp_path, off):
    _run_dir(tmp_path, [2])
    assert find_resume(off, tmp_path) is None


@pytest.mark.parametrize("on", ["true", "True"])
def test_resume_true_takes_the_newest_complete_checkpoint_of_this_run(tmp_path, on):
    run = _run_dir(tmp_path / "run", [2, 9, 10], incomplete=[12])  # 10 after 9 (not as text: zero-padded)
    assert find_resume(on, run) == run / "checkpoints" / "step_000010"


def test_resume_a_run_directory_its_checkpoints_or_one_checkpoint(tmp_path, monkeypatch):
    other = _run_dir(tmp_path / "other", [3, 4], incomplete=[5])
    here = tmp_path / "here"  # the new run's own directory has nothing
    assert find_resume(str(other), here) == other / "checkpoints" / "step_000004"
    assert find_resume(str(other / "checkpoints"), here) == other / "checkpoints" / "step_000004"
    assert find_resume(str(other / "checkpoints" / "step_000003"), here) == other / "checkpoints" / "step_000003"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert find_resume("~/other", here) == other / "checkpoints" / "step_000004"


@pytest.mark.parametrize("where", ["true", "missing", "incomplete"])
def test_resume_without_a_checkpoint_says_where_it_looked(tmp_path, where):
    run = _run_dir(tmp_path / "run", [], incomplete=[1])
    resume = {"true": "true", "missing": str(tmp_path / "nowhere"),
              "incomplete": str(run / "checkpoints" / "step_000001")}[where]
    with pytest.raises(ConfigError) as err:
        find_resume(resume, run)
    looked = run if where == "true" else Path(resume)
    assert str(err.value).startswith(f"resume={resume!r}: no checkpoint in {str(looked)!r}")


@pytest.mark.parametrize("resume", ["true", "step"])
def test_a_truncated_trainer_state_is_named_with_the_last_intact_checkpoint(tmp_path, resume):
    """A copy or a disk that stopped half-way: the file is named, and so is the checkpoint to resume instead."""
    run = _run_dir(tmp_path / "run", [2, 4])
    cut = run / "checkpoints" / "step_000004" / "trainer.pt"
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    given = "true" if resume == "true" else str(cut.parent)
    with pytest.raises(ConfigError) as err:
        find_resume(given, run)
    intact = run / "checkpoints" / "step_000002"
    assert str(err.value) == (f"resume={given!r}: {cut} is damaged or truncated (not a complete torch file); the "
                              f"last intact checkpoint is {intact}: resume={intact}")
    assert find_resume(str(intact), run) == intact


@pytest.mark.parametrize("cut_to", ["half", "header"])
def test_truncated_weights_are_named_with_the_last_intact_checkpoint(tmp_path, cut_to):
    """The same for the model's weights: a model.safetensors cut short (by half, or inside its header) is named,
    with the checkpoint to resume instead; the untouched checkpoint's file passes the same check."""
    from safetensors.torch import save_file

    run = _run_dir(tmp_path / "run", [2, 4])
    for step in (2, 4):
        save_file({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)},
                  str(checkpoint_dir(run, step) / "model" / "model.safetensors"))
    cut = checkpoint_dir(run, 4) / "model" / "model.safetensors"
    full = cut.stat().st_size
    with open(cut, "r+b") as f:
        f.truncate(full // 2 if cut_to == "half" else 20)
    with pytest.raises(ConfigError) as err:
        find_resume("true", run)
    intact = checkpoint_dir(run, 2)
    message = str(err.value)
    assert message.startswith(f"resume='true': {cut} is damaged or truncated (")
    assert message.endswith(f"); the last intact checkpoint is {intact}: resume={intact}")
    if cut_to == "half":  # the header is whole: the file is shorter than the tensors it lists
        assert f"({full // 2} bytes where its header says {full})" in message
    assert find_resume(str(intact), run) == intact


def test_side_files_are_copied_and_weights_are_not(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    side = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
            "qarl_build.json"]
    weights = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)] + [f"w{s}" for s in WEIGHT_SUFFIXES]
    for name in [*side, *weights, "config.json", "model.safetensors.index.json", ".gitattributes"]:
        (src / name).write_text(f"src {name}")
    (src / "subdir").mkdir()
    (dst / "config.json").write_text("the writer's config")  # what the writer of dst wrote itself stays
    assert copy_side_files(src, dst) == sorted(side)
    assert sorted(p.name for p in dst.iterdir()) == sorted([*side, "config.json"])
    assert (dst / "config.json").read_text() == "the writer's config"
    assert all((dst / n).read_text() == f"src {n}" for n in side)
    assert copy_side_files(src, dst) == []  # all there now


@pytest.mark.parametrize("eos, ids", [(7, {7}), ([7, 9], {7, 9}), ((3,), {3}), (None, set()), ([], set())])
def test_stop_ids_from_every_form_of_eos_token_id(eos, ids):
    assert stop_ids(eos) == frozenset(ids)


def test_decoding_drops_the_stop_token_the_engine_stopped_at():
    """A response that ended with a stop token is decoded without it; one cut at the length limit keeps all."""
    from qarl_cli.train.evaluate import decode
    from qarl_cli.rollout.base import RolloutBatch

    class Tok:
        eos_token_id = [1, 2]

        def batch_decode(self, rows, skip_special_tokens):
            return [" ".join(map(str, r)) for r in rows]

    batch = RolloutBatch([0, 0, 0], [[5, 6, 2], [5, 1], [5, 6, 1]], [[0.0] * 3, [0.0] * 2, [0.0] * 3],
                         ["stop", "stop", "length"])
    texts, flags = decode(batch, Tok(), max_tokens=3)
    assert texts == ["5 6", "5", "5 6 1"] and len(flags) == 3
