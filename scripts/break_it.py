"""A table of user mistakes run against the real CLI, each as the command a user types, in a scratch directory
holding what a user has (a model checkpoint, a run with a checkpoint, data files): exit code, wall time, the first
line said, and, where the command should refuse, whether the user's files are unchanged to the byte (names,
sizes, sha256: tests/disk_snapshot.py; Hydra's new outputs/ directories are not the user's and are left out).

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
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from disk_snapshot import changes, snapshot  # noqa: E402

QARL = [sys.executable, "-m", "qarl_cli.cli"]
CHEAP = ["rollout=torch", "steps=1", "eval_every=0", "prompts_per_step=2", "samples_per_prompt=2",
         "max_new_tokens=16", "reward.num_workers=1"]
NOT_THE_USERS = ("outputs", "multirun", "compare", ".cache")  # what commands create anew, and the model cache


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
    return {"m": m, "run": run, "ckpt": ckpt}


def cases(w: Path, p: dict[str, Path]) -> list[tuple[str, list[str], bool]]:
    """(what the user tried, the command's arguments, whether it must refuse)."""
    m, run, ckpt = p["m"], p["run"], p["ckpt"]
    hf = ["model=hf", f"model.path={m}"]
    return [
        ("quantize out= the source's parent, overwrite", ["quantize", *hf, "quant=int8", f"out={w / 'DIR'}",
                                                          "overwrite=true"], True),
        ("quantize out= the source itself, overwrite", ["quantize", *hf, "quant=int8", f"out={m}", "overwrite=true"],
         True),
        ("quantize out= a link to the source", ["quantize", *hf, "quant=int8", f"out={w / 'link'}", "overwrite=true"],
         True),
        ("quantize out= inside the source", ["quantize", *hf, "quant=int8", f"out={m / 'q'}"], True),
        ("quantize out= a run holding the source", ["quantize", "model=hf", f"model.path={ckpt / 'model'}",
                                                    "quant=int8", f"out={run}", "overwrite=true"], True),
        ("quantize out= a home-like directory, overwrite", ["quantize", *hf, "quant=int8", f"out={w / 'home'}",
                                                            "overwrite=true"], True),
        ("quantize out= a plain file, overwrite", ["quantize", *hf, "quant=int8", f"out={w / 'afile.txt'}",
                                                   "overwrite=true"], True),
        ("quantize out= existing, no overwrite", ["quantize", *hf, "quant=int8", f"out={w / 'home'}"], True),
        ("quantize quant= a typo", ["quantize", *hf, "quant=in8", f"out={w / 'q1'}"], True),
        ("quantize model.path= missing", ["quantize", "model=hf", f"model.path={w / 'nope'}", "quant=int8",
                                          f"out={w / 'q2'}"], True),
        ("quantize without out=", ["quantize", *hf, "quant=int8"], True),
        ("quantize a truncated model", ["quantize", "model=hf", f"model.path={w / 'CUTMODEL'}", "quant=int8",
                                        f"out={w / 'q3'}"], True),
        ("train overwrite a run that holds the source", ["train", "model=hf", f"model.path={ckpt / 'model'}",
                                                         f"hydra.run.dir={run}", "overwrite=true", *CHEAP], True),
        ("train fresh into a used run dir", ["train", *hf, f"hydra.run.dir={run}", *CHEAP], True),
        ("train dry run into a used run dir", ["train", *hf, f"hydra.run.dir={run}", "dry_run=true", *CHEAP], True),
        ("train resume another run into a used dir", ["train", *hf, f"resume={ckpt}", f"hydra.run.dir={w / 'OTHER'}",
                                                      *CHEAP], True),
        ("train resume=true with overwrite=true", ["train", *hf, "resume=true", "overwrite=true",
                                                   f"hydra.run.dir={run}", *CHEAP], True),
        ("train run dir inside the source", ["train", *hf, f"hydra.run.dir={m / 'run'}", *CHEAP], True),
        ("train overwrite removing its own data", ["train", *hf, "data=file",
                                                   f"data.path={run / 'checkpoints' / 'x.jsonl'}",
                                                   f"hydra.run.dir={run}", "overwrite=true", *CHEAP], True),
        ("train fresh after a stop in its first checkpoint", ["train", *hf, f"hydra.run.dir={w / 'STOPPED'}",
                                                              *CHEAP], True),
        ("train resume=true where no checkpoint is", ["train", *hf, "resume=true", f"hydra.run.dir={w / 'EMPTY'}",
                                                      *CHEAP], True),
        ("train resume a truncated trainer.pt", ["train", *hf, f"resume={w / 'RUN_CUT'}", *CHEAP], True),
        ("train samples_per_prompt=1000000", ["train", "samples_per_prompt=1000000"], True),
        ("train temperature=3 (vLLM: [0, 2])", ["train", "temperature=3"], True),
        ("train temperature=0.001 (vLLM raises it)", ["train", "temperature=0.001"], True),
        ("train max_new_tokens past the model", ["train", "max_new_tokens=100000"], True),
        ("train rollout.max_model_len past the model", ["train", "rollout.max_model_len=100000"], True),
        ("train seed=-1", ["train", "seed=-1"], True),
        ("train lr=-1", ["train", "lr=-1"], True),
        ("train lr=nan", ["train", "lr=nan"], True),
        ("train steps=0", ["train", "steps=0"], True),
        ("train samples_per_prompt=1", ["train", "samples_per_prompt=1"], True),
        ("train a key no schema has", ["train", "+foo=1"], True),
        ("train a typo in a key", ["train", "lerning_rate=1e-3"], True),
        ("train quant= a typo", ["train", "quant=nope"], True),
        ("train data.path on generated data", ["train", f"data.path={w / 'good.jsonl'}"], True),
        ("train parquet with wrong columns", ["train", *hf, "data=file", f"data.path={w / 'wrong.parquet'}",
                                              *CHEAP], True),
        ("train jsonl cut mid-line", ["train", *hf, "data=file", f"data.path={w / 'bad.jsonl'}", *CHEAP], True),
        ("train data.path missing", ["train", *hf, "data=file", f"data.path={w / 'nope.jsonl'}", *CHEAP], True),
        ("train model.path= a checkpoint folder", ["train", f"model.path={ckpt}", *CHEAP], True),
        ("eval model.path= a checkpoint folder", ["eval", f"model.path={ckpt}", "limit=2", "rollout=torch"], True),
        ("eval model=hf model.path= a checkpoint folder", ["eval", "model=hf", f"model.path={ckpt}", "limit=2",
                                                          "rollout=torch"], True),
        ("eval samples=99999", ["eval", "samples=99999"], True),
        ("eval limit=0", ["eval", "limit=0"], True),
        ("eval a truncated model", ["eval", "model=hf", f"model.path={w / 'CUTMODEL'}", "limit=2",
                                    "rollout=torch"], True),
        ("compare --out a run directory", ["compare", str(run), str(w / "OTHER"), "--out", str(run)], True),
        ("plot --out over metrics.jsonl", ["plot", str(run), "--out", str(run / "metrics.jsonl")], True),
        ("plot a directory that is not there", ["plot", str(w / "nope")], True),
        ("a sweep with one bad value", ["train", "-m", "lr=1e-3,-1"], True),
        ("a misspelt command", ["trian"], True),
        ("train a misspelt setting without +", ["train", "lrr=1"], True),
        ("train eval_samples where eval_every=0", ["train", "eval_every=0", "eval_samples=2"], True),
        ("train data.test_size beside data.test_path", ["train", *hf, "data=file", f"data.path={w / 'good.jsonl'}",
                                                        f"data.test_path={w / 'good.jsonl'}", "data.test_size=5",
                                                        *CHEAP], True),
        ("train sync.verify_tolerance where verify_every=0", ["train", "sync.verify_every=0",
                                                               "sync.verify_tolerance=0.1"], True),
        ("train resume a truncated model.safetensors", ["train", *hf, f"resume={w / 'RUN_CUTW'}", *CHEAP], True),
        ("a sweep into a directory holding one", ["train", "-m", f"hydra.sweep.dir={w / 'SWEEP'}", *hf, *CHEAP,
                                                  "lr=1e-3,2e-3"], True),
        ("quantize into a new directory (works)", ["quantize", *hf, "quant=int8", f"out={w / 'int8'}"], False),
        ("train one cheap step (works)", ["train", *hf, f"hydra.run.dir={w / 'NEW'}", *CHEAP], False),
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
        for i, (what, argv, refuse) in enumerate(cases(w, paths), start=1):
            if only and i not in only:
                continue
            before = users_files(w)
            row = run(argv, w, args.timeout)
            diff = changes(before, users_files(w))
            row = {"case": i, "what": what, "command": "qarl " + " ".join(argv).replace(str(w), "W"),
                   "refusal_expected": refuse, **row, "first_line": row["first_line"].replace(str(w), "W"),
                   "disk_unchanged": (not diff) if refuse else None, "changed": diff[:5] if refuse else []}
            rows.append(row)
            print(f"{i:2d} rc={row['rc']} {row['seconds']:6.1f}s unchanged={row['disk_unchanged']} {what}",
                  flush=True)
    table = Table(title="qarl: a user's mistakes (scripts/break_it.py)", show_lines=False)
    for col in ("#", "case", "exit", "s", "first line", "disk unchanged"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["case"]), r["what"], str(r["rc"]), f"{r['seconds']:.1f}", r["first_line"][:160],
                      {True: "yes", False: "NO", None: "-"}[r["disk_unchanged"]])
    Console(width=220).print(table)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r["case"] for r in rows if r["refusal_expected"] and (r["rc"] == 0 or not r["disk_unchanged"]
                                                                 or r["traceback"])]
    print(f"[break_it] {len(rows)} cases -> {args.out}; refused as they should, nothing changed, no traceback: "
          f"{len(rows) - len(bad)}; not: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
