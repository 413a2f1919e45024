"""Nothing a user types destroys what exists (machine.disk, train.rundir.check_paths, quantize's check_paths):
every command that removes or replaces a path refuses, before it writes anything, an output that is, contains or
lies inside its input (through symbolic links too), `overwrite=true` on what is not a checkpoint, and a resume
that would cut another run's records. Each refusal is one line, and the trees involved are unchanged to the
byte (tests/disk_snapshot.py)."""

import shutil

import pytest

from disk_snapshot import Unchanged, changes, snapshot
from qarl_cli.cli import main
from qarl_cli.config.errors import ConfigError
from qarl_cli.machine.disk import relation


QUICK = ["rollout=torch", "steps=1", "eval_every=0", "prompts_per_step=2", "samples_per_prompt=2",
         "max_new_tokens=16"]  # should
# a refusal regress, the run that follows is short


def _one_line(capsys, *parts):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and all(p in err[0] for p in parts), err
    return err[0]


@pytest.fixture
def src(models, tmp_path):
    """A user's directory holding a model checkpoint and something else of theirs."""
    shutil.copytree(models["dense"], tmp_path / "DIR" / "m")
    (tmp_path / "DIR" / "notes.txt").write_text("mine\n")
    return tmp_path / "DIR" / "m"


def test_relation_sees_through_symbolic_links(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert relation(tmp_path / "a", tmp_path / "a" / "b") == "contains"
    assert relation(tmp_path / "a" / "b" / "c", tmp_path / "a") == "is inside"
    assert relation(tmp_path / "link", tmp_path / "a") == "is"
    assert relation(tmp_path / "link" / "b", tmp_path / "a") == "is inside"
    assert relation(tmp_path / "a" / "b", tmp_path / "link") == "is inside"  # the link is the parent
    assert relation(tmp_path / "a", tmp_path / "ab") is None  # a shared prefix is not a parent


@pytest.mark.parametrize("out, how", [
    ("DIR", "contains"),  # the probe's case: exited 0 and the source was gone
    ("DIR/m", "is"),
    ("DIR/m/q", "is inside"),
    ("link", "is"),  # a symbolic link to the source
    ("dirlink", "contains"),  # a symbolic link to the source's parent
])
def test_quantize_refuses_an_out_that_overlaps_its_source(src, tmp_path, monkeypatch, capsys, out, how):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(src)
    (tmp_path / "dirlink").symlink_to(src.parent)
    with Unchanged(tmp_path):  # nothing at all: not even Hydra's outputs/
        assert main(["quantize", "model=hf", f"model.path={src}", "quant=int8", f"out={tmp_path / out}",
                     "overwrite=true"]) == 2
    _one_line(capsys, f"out={str(tmp_path / out)!r} {how} model.path={str(src)!r}")


@pytest.mark.parametrize("what", ["home", "file"])
def test_quantize_overwrite_replaces_only_a_checkpoint(src, tmp_path, monkeypatch, capsys, what):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / what
    if what == "home":  # a directory of the user's: out=~ overwrite=true would have replaced it whole
        (out / "projects").mkdir(parents=True)
        (out / "config.json").write_text("{}")
    else:
        out.write_text("a file\n")
    with Unchanged(tmp_path):
        assert main(["quantize", "model=hf", f"model.path={src}", "quant=int8", f"out={out}",
                     "overwrite=true"]) == 2
    _one_line(capsys, f"out={str(out)!r}", "overwrite=true replaces only a checkpoint")


def test_quantize_overwrite_swaps_a_checkpoint_in_whole(src, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "q"
    assert main(["quantize", "model=hf", f"model.path={src}", "quant=int8", f"out={out}"]) == 0
    first = snapshot(out)
    with Unchanged(src.parent):
        assert main(["quantize", "model=hf", f"model.path={src}", "quant=w4a16", f"out={out}",
                     "overwrite=true"]) == 0
    assert changes(first, snapshot(out))  # replaced, and nothing beside it left over
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def _run_with_checkpoint(models, tmp_path):
    """A run directory as training leaves it: records and a checkpoint whose model/ is a real checkpoint."""
    run = tmp_path / "RUN"
    model = run / "checkpoints" / "step_000002" / "model"
    shutil.copytree(models["dense"], model)
    import torch

    torch.save({"step": 2}, model.parent / "trainer.pt")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("lr: 0.002\n")
    return run, model


def test_train_overwrite_refuses_a_run_directory_holding_its_source(models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run, model = _run_with_checkpoint(models, tmp_path)
    with Unchanged(tmp_path):
        assert main(["train", "model=hf", f"model.path={model}", f"hydra.run.dir={run}", "overwrite=true",
                     *QUICK]) == 2
    _one_line(capsys, f"hydra.run.dir={str(run)!r} contains model.path={str(model)!r}")


def test_train_refuses_a_run_directory_inside_its_source(models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "m"
    shutil.copytree(models["dense"], model)
    with Unchanged(tmp_path):
        assert main(["train", "model=hf", f"model.path={model}", f"hydra.run.dir={model / 'run'}",
                     *QUICK]) == 2
    _one_line(capsys, "is inside model.path=")


@pytest.mark.parametrize("extra", [[], ["dry_run=true"]])
def test_a_refused_fresh_run_leaves_the_run_directory_as_it_was(models, tmp_path, monkeypatch, capsys, extra):
    """Refused at compose time: before, Hydra had already written .hydra/<id>/, the lock and its log there (and
    a dry run was let through, writing its records into the other run's)."""
    monkeypatch.chdir(tmp_path)
    run, _ = _run_with_checkpoint(models, tmp_path)
    with Unchanged(tmp_path):
        assert main(["train", "model=hf", f"model.path={models['dense']}", f"hydra.run.dir={run}", *QUICK,
                     *extra]) == 2
    _one_line(capsys, "already holds a run", "resume=true")


def test_resume_of_another_run_refuses_a_directory_holding_a_run(models, tmp_path, monkeypatch, capsys):
    """A resume cuts its run directory's metrics.jsonl back to the checkpoint's step: of another run's, that is
    that run's record lost."""
    monkeypatch.chdir(tmp_path)
    run, _ = _run_with_checkpoint(models, tmp_path)
    other = tmp_path / "OTHER"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    with Unchanged(tmp_path):
        assert main(["train", "model=hf", f"model.path={models['dense']}",
                     f"resume={run / 'checkpoints' / 'step_000002'}", f"hydra.run.dir={other}",
                     *QUICK]) == 2
    _one_line(capsys, "holds a run of its own")


def test_overwrite_and_resume_together_are_refused(models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run, _ = _run_with_checkpoint(models, tmp_path)
    with Unchanged(tmp_path):
        assert main(["train", "model=hf", f"model.path={models['dense']}", "resume=true", "overwrite=true",
                     f"hydra.run.dir={run}", *QUICK]) == 2
    _one_line(capsys, "overwrite=true with resume=", "choose one")


def test_overwrite_refuses_to_remove_the_data_the_run_reads(models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "RUN"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    data = run / "checkpoints" / "train.jsonl"
    data.write_text("".join(f'{{"question": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(40)))
    with Unchanged(tmp_path):
        assert main(["train", "model=hf", f"model.path={models['dense']}", "data=file", f"data.path={data}",
                     f"hydra.run.dir={run}", "overwrite=true",
                     *QUICK]) == 2
    _one_line(capsys, "overwrite=true replaces", "contains data.path=")


def test_check_paths_refuses_in_the_library_too(models, tmp_path):
    """write_checkpoint (also what `qarl serve` writes its served checkpoint with) refuses on its own."""
    from qarl_cli.config.quant import SCHEMAS
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.checkpoint import write_checkpoint

    src = tmp_path / "DIR" / "m"
    shutil.copytree(models["dense"], src)
    with Unchanged(tmp_path), pytest.raises(ConfigError, match="contains model.path"):
        write_checkpoint(src, src.parent, build_scheme(SCHEMAS["int8"](), "cpu"), overwrite=True, progress=False)


def test_a_resume_with_nothing_to_resume_leaves_the_directory_as_it_was(models, tmp_path, monkeypatch, capsys):
    """Found at compose time: before, Hydra had written .hydra/ and the lock into it first."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY").mkdir()
    with Unchanged(tmp_path):
        assert main(["train", "model=hf", f"model.path={models['dense']}", "resume=true",
                     f"hydra.run.dir={tmp_path / 'EMPTY'}", *QUICK]) == 2
    _one_line(capsys, "resume='true': no checkpoint in")
