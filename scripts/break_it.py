"""A table of user mistakes run against the real CLI, each as the command a user types, in a scratch directory
holding what a user has (a model checkpoint, a run with a checkpoint, data files): exit code, wall time, the first
line said, and, where the command should refuse, whether the user's files are unchanged to the byte (names,
sizes, sha256: tests/disk_snapshot.py; Hydra's new outputs/ directories are not the user's and are left out).
Where something outside the user's reach fails (a device that fills up mid-run, a real 5 MiB tmpfs where this
process may mount one), the failure must be one line and what was written before it intact.

    .venv/bin/python scripts/break_it.py [--out docs/break_it.json] [--only 1,5,12]

About 60 commands, most refused at compose time in seconds: a few minutes on 2 CPU cores."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from disk_snapshot import changes, snapshot  # noqa: E402

QARL = [sys.executable, "-m", "qarl_cli.cli"]
CHEAP = ["rollout=torch", "steps=1", "eval_every=0", "prompts_per_step=2", "samples_per_prompt=2",
         "max_new_tokens=16", "reward.num_workers=1"]
NOT_THE_USERS = ("outputs", "multirun", "compare", ".cache")  # what commands create anew, and the model cache
REFUSED, WORKS, FAILS = "refused", "works", "fails"


def workspace(w: Path) -> dict[str, Path]:
    """The user's files: DIR/m (a model, untrained tiny), RUN (a run with records and checkpoint step 2),
    OTHER (another run's records), data files, a home-like directory and a plain file."""
    import torch

    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(TinyModelConfig(cache_dir=str(w / ".cache"), warm_start_steps=0), log=lambda _: None)
    m = w / "DIR" / "m"
    shutil.copytree(tiny, m)
    (w / "DIR" / "notes.txt").write_text("the user's own notes\n")
    run = w / "RUN"
    ckpt = run / "checkpoints" / "step_000002"
    shutil.copytree(tiny, ckpt / "model")
    torch.save({"step": 2}, ckpt / "trainer.pt")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "status.json").write_text('{"status": "finished", "error": null}\n')
    shutil.copytree(run, w / "RUN_CUT")
    cut = w / "RUN_CUT" / "checkpoints" / "step_000002" / "trainer.pt"
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    (w / "STOPPED" / "checkpoints" / ".step_000001.tmp-1").mkdir(parents=True)  # SIGTERM in its first checkpoint
    (w / "STOPPED" / "metrics.jsonl").write_text('{"step": 1}\n')
    (w / "OTHER").mkdir()
    (w / "OTHER" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    (w / "EMPTY").mkdir()
    (w / "home" / "projects").mkdir(parents=True)
    (w / "home" / "config.json").write_text("{}\n")
    (w / "afile.txt").write_text("keep me\n")
    (w / "link").symlink_to(m)
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(40)]
    (w / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"Query": "1+1", "Target": "2"}]), w / "wrong.parquet")
    (w / "bad.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n{"question": \n')
    shutil.copytree(tiny, w / "CUTMODEL")
    weights = w / "CUTMODEL" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    shutil.copytree(run, w / "RUN_CUTW")  # a checkpoint whose model.safetensors lost its end
    cutw = w / "RUN_CUTW" / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    with open(cutw, "r+b") as f:
        f.truncate(cutw.stat().st_size - 1000)
    (w / "SWEEP" / "0").mkdir(parents=True)  # an earlier sweep's directory
    (w / "SWEEP" / "multirun.yaml").write_text("hydra: {}\n")
    (w / "SWEEP" / "0" / "metrics.jsonl").write_text('{"step": 1}\n')
    return {"m": m, "run": run, "ckpt": ckpt, "full": small_filesystem(w / "FULL")}


def small_filesystem(where: Path) -> Path | str:
    """A 5 MiB tmpfs at `where`: room for the tiny model's first checkpoint (3.2 MB, no optimizer state yet) and not
    its second (6.5 MB with AdamW's moments), so a run's second checkpoint meets a really full device. Mounting
    needs root (or CAP_SYS_ADMIN); elsewhere the reason, and the case is skipped."""
    where.mkdir()
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(where)], capture_output=True,
                             text=True)
    except OSError as e:  # no mount(8) on this machine
        return f"cannot mount a 5 MiB tmpfs here ({e.strerror}: mount)"
    return where if out.returncode == 0 else f"cannot mount a 5 MiB tmpfs here ({out.stderr.strip()[:80]})"


def unmount(where: Path | str) -> None:
    if isinstance(where, Path):
        subprocess.run(["umount", str(where)], check=False)


def intact_checkpoint(ckpt: Path) -> Callable[[], tuple[str, bool]]:
    """Whether a checkpoint still loads whole: its model's tensors and its trainer state."""
    def check() -> tuple[str, bool]:
        import torch
        from safetensors.torch import load_file

        try:
            load_file(ckpt / "model" / "model.safetensors")
            torch.load(ckpt / "trainer.pt", weights_only=False)
            return f"{ckpt.name} intact", True
        except Exception as e:  # noqa: BLE001 (what a damaged file raises varies; the check is that none does)
            return f"{ckpt.name} damaged: {e}"[:120], False
    return check


def exists(path: Path) -> Callable[[], tuple[str, bool]]:
    return lambda: (f"{path.name} written", path.exists())


def cases(w: Path, p: dict) -> list[tuple]:
    """(what the user tried, the command's arguments, what must happen, and optionally a check of what is on disk
    afterwards). REFUSED: exit non-zero in one line, the user's files unchanged to the byte; WORKS: exit 0; FAILS:
    an error outside the user's reach (a full device) in one line, exit non-zero, what was written before intact."""
    m, run, ckpt, full = p["m"], p["run"], p["ckpt"], p["full"]
    hf = ["model=hf", f"model.path={m}"]
    return [
        ("quantize out= the source's parent, overwrite", ["quantize", *hf, "quant=int8", f"out={w / 'DIR'}",
                                                          "overwrite=true"], REFUSED),
        ("quantize out= the source itself, overwrite", ["quantize", *hf, "quant=int8", f"out={m}", "overwrite=true"],
         REFUSED),
        ("quantize out= a link to the source", ["quantize", *hf, "quant=int8", f"out={w / 'link'}", "overwrite=true"],
         REFUSED),
        ("quantize out= inside the source", ["quantize", *hf, "quant=int8", f"out={m / 'q'}"], REFUSED),
        ("quantize out= a run holding the source", ["quantize", "model=hf", f"model.path={ckpt / 'model'}",
                                                    "quant=int8", f"out={run}", "overwrite=true"], REFUSED),
        ("quantize out= a home-like directory, overwrite", ["quantize", *hf, "quant=int8", f"out={w / 'home'}",
                                                            "overwrite=true"], REFUSED),
        ("quantize out= a plain file, overwrite", ["quantize", *hf, "quant=int8", f"out={w / 'afile.txt'}",
                                                   "overwrite=true"], REFUSED),
        ("quantize out= existing, no overwrite", ["quantize", *hf, "quant=int8", f"out={w / 'home'}"], REFUSED),
        ("quantize quant= a typo", ["quantize", *hf, "quant=in8", f"out={w / 'q1'}"], REFUSED),
        ("quantize model.path= missing", ["quantize", "model=hf", f"model.path={w / 'nope'}", "quant=int8",
                                          f"out={w / 'q2'}"], REFUSED),
        ("quantize without out=", ["quantize", *hf, "quant=int8"], REFUSED),
        ("quantize a truncated model", ["quantize", "model=hf", f"model.path={w / 'CUTMODEL'}", "quant=int8",
                                        f"out={w / 'q3'}"], REFUSED),
        ("train overwrite a run that holds the source", ["train", "model=hf", f"model.path={ckpt / 'model'}",
                                                         f"hydra.run.dir={run}", "overwrite=true", *CHEAP], REFUSED),
        ("train fresh into a used run dir", ["train", *hf, f"hydra.run.dir={run}", *CHEAP], REFUSED),
        ("train dry run into a used run dir", ["train", *hf, f"hydra.run.dir={run}", "dry_run=true", *CHEAP], REFUSED),
        ("train resume another run into a used dir", ["train", *hf, f"resume={ckpt}", f"hydra.run.dir={w / 'OTHER'}",
                                                      *CHEAP], REFUSED),
        ("train resume=true with overwrite=true", ["train", *hf, "resume=true", "overwrite=true",
                                                   f"hydra.run.dir={run}", *CHEAP], REFUSED),
        ("train run dir inside the source", ["train", *hf, f"hydra.run.dir={m / 'run'}", *CHEAP], REFUSED),
        ("train overwrite removing its own data", ["train", *hf, "data=file",
                                                   f"data.path={run / 'checkpoints' / 'x.jsonl'}",
                                                   f"hydra.run.dir={run}", "overwrite=true", *CHEAP], REFUSED),
        ("train fresh after a stop in its first checkpoint", ["train", *hf, f"hydra.run.dir={w / 'STOPPED'}",
                                                              *CHEAP], REFUSED),
        ("train resume=true where no checkpoint is", ["train", *hf, "resume=true", f"hydra.run.dir={w / 'EMPTY'}",
                                                      *CHEAP], REFUSED),
        ("train resume a truncated trainer.pt", ["train", *hf, f"resume={w / 'RUN_CUT'}", *CHEAP], REFUSED),
        ("train samples_per_prompt=1000000", ["train", "samples_per_prompt=1000000"], REFUSED),
        ("train temperature=3 (vLLM: [0, 2])", ["train", "temperature=3"], REFUSED),
        ("train temperature=0.001 (vLLM raises it)", ["train", "temperature=0.001"], REFUSED),
        ("train max_new_tokens past the model", ["train", "max_new_tokens=100000"], REFUSED),
        ("train rollout.max_model_len past the model", ["train", "rollout.max_model_len=100000"], REFUSED),
        ("train seed=-1", ["train", "seed=-1"], REFUSED),
        ("train lr=-1", ["train", "lr=-1"], REFUSED),
        ("train lr=nan", ["train", "lr=nan"], REFUSED),
        ("train steps=0", ["train", "steps=0"], REFUSED),
        ("train samples_per_prompt=1", ["train", "samples_per_prompt=1"], REFUSED),
        ("train a key no schema has", ["train", "+foo=1"], REFUSED),
        ("train a typo in a key", ["train", "lerning_rate=1e-3"], REFUSED),
        ("train quant= a typo", ["train", "quant=nope"], REFUSED),
        ("train data.path on generated data", ["train", f"data.path={w / 'good.jsonl'}"], REFUSED),
        ("train parquet with wrong columns", ["train", *hf, "data=file", f"data.path={w / 'wrong.parquet'}",
                                              *CHEAP], REFUSED),
        ("train jsonl cut mid-line", ["train", *hf, "data=file", f"data.path={w / 'bad.jsonl'}", *CHEAP], REFUSED),
        ("train data.path missing", ["train", *hf, "data=file", f"data.path={w / 'nope.jsonl'}", *CHEAP], REFUSED),
        ("train model.path= a checkpoint folder", ["train", f"model.path={ckpt}", *CHEAP], REFUSED),
        ("eval model.path= a checkpoint folder", ["eval", f"model.path={ckpt}", "limit=2", "rollout=torch"], REFUSED),
        ("eval model=hf model.path= a checkpoint folder", ["eval", "model=hf", f"model.path={ckpt}", "limit=2",
                                                          "rollout=torch"], REFUSED),
        ("eval samples=99999", ["eval", "samples=99999"], REFUSED),
        ("eval limit=0", ["eval", "limit=0"], REFUSED),
        ("eval a truncated model", ["eval", "model=hf", f"model.path={w / 'CUTMODEL'}", "limit=2",
                                    "rollout=torch"], REFUSED),
        ("compare --out a run directory", ["compare", str(run), str(w / "OTHER"), "--out", str(run)], REFUSED),
        ("plot --out over metrics.jsonl", ["plot", str(run), "--out", str(run / "metrics.jsonl")], REFUSED),
        ("plot a directory that is not there", ["plot", str(w / "nope")], REFUSED),
        ("a sweep with one bad value", ["train", "-m", "lr=1e-3,-1"], REFUSED),
        ("a misspelt command", ["trian"], REFUSED),
        ("train a misspelt setting without +", ["train", "lrr=1"], REFUSED),
        ("train eval_samples where eval_every=0", ["train", "eval_every=0", "eval_samples=2"], REFUSED),
        ("train data.test_size beside data.test_path", ["train", *hf, "data=file", f"data.path={w / 'good.jsonl'}",
                                                        f"data.test_path={w / 'good.jsonl'}", "data.test_size=5",
                                                        *CHEAP], REFUSED),
        ("train sync.verify_tolerance where verify_every=0", ["train", "sync.verify_every=0",
                                                               "sync.verify_tolerance=0.1"], REFUSED),
        ("train resume a truncated model.safetensors", ["train", *hf, f"resume={w / 'RUN_CUTW'}", *CHEAP], REFUSED),
        ("a sweep into a directory holding one", ["train", "-m", f"hydra.sweep.dir={w / 'SWEEP'}", *hf, *CHEAP,
                                                  "lr=1e-3,2e-3"], REFUSED),
        ("quantize into a new directory (works)", ["quantize", *hf, "quant=int8", f"out={w / 'int8'}"], WORKS),
        ("train one cheap step, eval_every=0 (works)", ["train", *hf, f"hydra.run.dir={w / 'NEW'}", *CHEAP], WORKS,
         exists(w / "NEW" / "summary.json")),
        ("train on a full device (a 5 MiB filesystem)",
         ["train", f"hydra.run.dir={w / 'FULL' / 'run'}", *CHEAP, "steps=2", "checkpoint_every=1"], FAILS,
         intact_checkpoint(w / "FULL" / "run" / "checkpoints" / "step_000001") if isinstance(full, Path) else full),
    ]


def run(args: list[str], cwd: Path, timeout: float) -> dict:
    start = time.monotonic()
    try:
        out = subprocess.run([*QARL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "QARL_CACHE_DIR": str(cwd / ".cache"),
                                  "HF_HUB_OFFLINE": "1"})
        rc, err, std = out.returncode, out.stderr, out.stdout
    except subprocess.TimeoutExpired as e:
        rc, err, std = "timeout", (e.stderr or b"").decode(errors="replace"), ""
    lines = [ln for ln in err.splitlines() + std.splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("qarl ")] or \
        [ln for ln in lines if not ln.startswith("[qarl] ") and "it/s]" not in ln and "s/it]" not in ln] or lines
    return {"rc": rc, "seconds": round(time.monotonic() - start, 1), "first_line": said[0][:400] if said else "",
            "traceback": "Traceback" in err}


def users_files(w: Path) -> dict:
    return {k: v for k, v in snapshot(w).items() if k.split("/")[0] not in NOT_THE_USERS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "break_it.json")
    ap.add_argument("--only", default="", help="case numbers, comma separated")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    only = {int(x) for x in args.only.split(",") if x}
    rows = []
    with tempfile.TemporaryDirectory(prefix="qarl-break-it-") as tmp:
        w = Path(tmp)
        paths = workspace(w)
        try:
            for i, (what, argv, expect, *check) in enumerate(cases(w, paths), start=1):
                if only and i not in only:
                    continue
                rows.append(one_case(i, what, argv, expect, check[0] if check else None, w, args.timeout))
                r = rows[-1]
                print(f"{i:2d} rc={r['rc']} {r['seconds']:6.1f}s unchanged={r['disk_unchanged']} {what}", flush=True)
        finally:
            unmount(paths["full"])
    table = Table(title="qarl: a user's mistakes (scripts/break_it.py)", show_lines=False)
    for col in ("#", "case", "expect", "exit", "s", "first line", "disk unchanged", "check"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["case"]), r["what"], r["expect"], str(r["rc"]), f"{r['seconds']:.1f}",
                      escape(r["first_line"][:200]), {True: "yes", False: "NO", None: "-"}[r["disk_unchanged"]],
                      "" if r["check"] is None else f"{r['check']}: {'yes' if r['check_ok'] else 'NO'}")
    Console(width=240).print(table)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r["case"] for r in rows if not r["as_expected"]]
    print(f"[break_it] {len(rows)} cases -> {args.out}; as expected (refused in one line with the files unchanged, "
          f"worked, or failed in one line with what was written intact): {len(rows) - len(bad)}; not: "
          f"{bad or 'none'}")
    return 1 if bad else 0


def one_case(i: int, what: str, argv: list[str], expect: str, check: Callable | str | None, w: Path,
             timeout: float) -> dict:
    """Run one case and judge it; a check given as a string is the reason it cannot run here (skipped)."""
    base = {"case": i, "what": what, "command": "qarl " + " ".join(argv).replace(str(w), "W"), "expect": expect,
            "refusal_expected": expect == REFUSED}
    if isinstance(check, str):
        return {**base, "rc": "skipped", "seconds": 0.0, "first_line": check, "traceback": False,
                "disk_unchanged": None, "changed": [], "check": None, "check_ok": None, "as_expected": True}
    before = users_files(w)
    row = run(argv, w, timeout)
    diff = changes(before, users_files(w))
    label, ok = check() if check else (None, None)
    one_line = isinstance(row["rc"], int) and not row["traceback"]
    as_expected = {REFUSED: one_line and row["rc"] != 0 and not diff,
                   WORKS: row["rc"] == 0,
                   FAILS: one_line and row["rc"] != 0}[expect] and ok is not False
    return {**base, **row, "first_line": row["first_line"].replace(str(w), "W"),
            "disk_unchanged": (not diff) if expect == REFUSED else None, "changed": diff[:5] if expect == REFUSED
            else [], "check": label, "check_ok": ok, "as_expected": as_expected}


if __name__ == "__main__":
    sys.exit(main())
