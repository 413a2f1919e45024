"""The server cases a user or a failing machine runs into with `rollout=vllm_server` and `qarl serve`, each run as
the command a user types: exit code, wall time and the first line of what it printed (stderr first), as a table
and as JSON. One int8 `qarl serve` (tiny_arith) is started for the attach cases and stopped at the end.

    .venv/bin/python scripts/server_cases.py [--out runs/server_cases.json] [--only 1a,3]

Case 2 (an asynchronous run killed after step 2 and resumed) trains 4 short steps twice: a few minutes."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests
from rich.console import Console
from rich.table import Table

QARL = [sys.executable, "-m", "qarl_cli.cli"]
CHEAP = ["steps=1", "eval_every=0", "checkpoint_every=0", "prompts_per_step=2", "samples_per_prompt=2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], cwd: Path, timeout: float = 600, interrupt_after: float | None = None,
        grep: str = "") -> dict:
    """One command: exit code, seconds, first line (stderr, else stdout); with interrupt_after, SIGINT then and the
    seconds from the signal to the exit."""
    start = time.monotonic()
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    signalled = None
    if interrupt_after is not None:
        try:
            proc.wait(interrupt_after)
        except subprocess.TimeoutExpired:
            signalled = time.monotonic()
            proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    end = time.monotonic()
    # The line a user reads first: qarl's one-line error where there is one, else the first that is not a
    # progress bar (transformers' weight-loading bar is on stderr) nor a [qarl] progress line
    lines = [ln for ln in (err.splitlines() + out.splitlines()) if ln.strip()]
    said = [ln for ln in lines if ln.startswith("qarl ")] or \
        [ln for ln in lines if not ln.startswith("[qarl] ") and "it/s]" not in ln and "s/it]" not in ln]
    row = {"rc": proc.returncode, "seconds": round(end - start, 1), "first_line": said[0][:300] if said else ""}
    if grep:
        row["grep"] = next((ln for ln in err.splitlines() + out.splitlines() if grep in ln), "")
    if signalled is not None:
        row["seconds_after_ctrl_c"] = round(end - signalled, 1)
    return row


def start_server(workdir: Path, key: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (workdir / "serve.log").open("w")
    proc = subprocess.Popen([*QARL, "serve", "quant=int8", f"rollout.base_port={port}", f"rollout.api_key={key}",
                             f"hydra.run.dir={workdir / 'serve'}"], cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server_cases: qarl serve exited ({workdir / 'serve.log'})")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(1)
    raise SystemExit("server_cases: qarl serve did not become healthy in 600 s")


def probe_logprobs(url: str, key: str) -> list[float]:
    """The server's logprobs of a fixed sequence (what any client would see)."""
    model = requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    body = {"model": model["data"][0]["id"], "prompt": [5, 17, 33, 8, 21, 40, 9, 12], "max_tokens": 1,
            "temperature": 0.0, "prompt_logprobs": 0}
    r = requests.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    return [next(iter(e.values()))["logprob"] for e in r.json()["choices"][0]["prompt_logprobs"][1:]]


def resume_case(workdir: Path) -> dict:
    """steps=4, max_staleness=1, a checkpoint every step: one run unbroken, one SIGKILLed as soon as step 2's
    checkpoint exists and resumed; staleness and reward per step of both."""
    args = [*QARL, "train", "rollout=vllm", "steps=4", "rollout.max_staleness=1", "checkpoint_every=1",
            "eval_every=0", "prompts_per_step=8", "samples_per_prompt=4"]
    unbroken, broken = workdir / "async-unbroken", workdir / "async-resumed"
    for d in (unbroken, broken):  # an earlier measurement's runs
        shutil.rmtree(d, ignore_errors=True)
    subprocess.run([*args, f"hydra.run.dir={unbroken}"], cwd=workdir, capture_output=True)
    proc = subprocess.Popen([*args, f"hydra.run.dir={broken}"], cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    while proc.poll() is None and not (broken / "checkpoints" / "step_000002").is_dir():
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    row = run([*args, f"hydra.run.dir={broken}", "resume=true"], workdir, grep="staleness")
    for name, d in (("unbroken", unbroken), ("resumed", broken)):
        steps = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
        row[f"{name}_staleness"] = [s.get("rollout/staleness_mean") for s in steps]
        row[f"{name}_reward"] = [s.get("reward/mean") for s in steps]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/server_cases.json"))
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    workdir = args.out.parent.resolve() / "server_cases"
    workdir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(16)
    server, url = start_server(workdir, key)
    attach = ["rollout=vllm_server", f"rollout.urls=[{url}]", *CHEAP]
    own = ["rollout=vllm_server", *CHEAP]
    cases = {
        "1a": ("int8 server, run with quant=none", [*attach, f"rollout.api_key={key}", "quant=none"]),
        "1b": ("tiny_arith server, run with model=tiny_moe", [*attach, f"rollout.api_key={key}", "quant=int8",
                                                             "model=tiny_moe"]),
        "3": ("nothing listening at the URL", ["rollout=vllm_server", "rollout.urls=[http://127.0.0.1:1]", *CHEAP]),
        "4a": ("num_servers=100", [*own, "rollout.num_servers=100"]),
        "4b": ("Ctrl-C 10 s into a server's start-up", own),
        "5": ("wrong key", [*attach, "rollout.api_key=not-the-key", "quant=int8"]),
        "6": ("server on another transfer backend", [*attach, f"rollout.api_key={key}", "quant=int8",
                                                    "rollout.transfer_backend=qarl_gloo"]),
        "7a": ("rollout.devices=[abc]", [*own, "rollout.devices=[abc]"]),
        "7b": ("rollout.base_port=70000", [*own, "rollout.base_port=70000"]),
        "7c": ("base port already taken", [*own, f"rollout.base_port={free_port()}"]),
        "7d": ("rollout.base_port=-5", [*own, "rollout.base_port=-5"]),
        "7e": ("rollout.request_timeout_s=0", [*own, "rollout.request_timeout_s=0"]),
        "8a": ("URL without a scheme", ["rollout=vllm_server", "rollout.urls=[127.0.0.1:8000]", *CHEAP]),
        "8b": ("ftp:// URL", ["rollout=vllm_server", "rollout.urls=[ftp://127.0.0.1:8000]", *CHEAP]),
    }
    only = set(filter(None, args.only.split(",")))
    results: dict = {}
    holder = None
    try:
        before = probe_logprobs(url, key)
        for name, (what, overrides) in cases.items():
            if only and name not in only:
                continue
            if name == "7c":  # hold the port while the run tries it
                holder = socket.socket()
                holder.bind(("127.0.0.1", int(overrides[-1].split("=")[1])))
                holder.listen()
            row = run([*QARL, "train", *overrides, f"hydra.run.dir={workdir / ('run-' + name)}"], workdir,
                      interrupt_after=10 if name == "4b" else None)
            if holder is not None:
                holder.close()
                holder = None
            results[name] = {"case": what, **row}
            print(f"{name}: rc {row['rc']}, {row['seconds']} s: {row['first_line']}", flush=True)
        results["server_unchanged"] = probe_logprobs(url, key) == before
        if not only or "2" in only:
            results["2"] = {"case": "async run killed after step 2, resumed", **resume_case(workdir)}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    table = Table("case", "what", "rc", "s", "first line")
    for name, row in results.items():
        if isinstance(row, dict):
            table.add_row(name, row["case"], str(row["rc"]), str(row.get("seconds_after_ctrl_c", row["seconds"])),
                          row["first_line"])
    Console(width=200).print(table)
    print(f"the int8 server answers the probe as before: {results.get('server_unchanged')}")
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
