"""Where the suite's time goes, and the order that lets two workers finish together.

Reads the junit XML of a suite run (`make test PYTEST_ADDOPTS=--junitxml=J.xml`), prints the slowest tests and
each file's seconds, and simulates pytest-xdist's `--dist loadfile` on N workers (a worker takes the next whole
file when it has two tests or fewer left) for two orders of the files: xdist's default (most tests first) and
the most seconds first, which tests/conftest.py applies from the JSON this writes.

    .venv/bin/python scripts/test_durations.py J.xml [--workers 2] [--top 40] [--write tests/file_seconds.json]
        [--before J0.xml]

With --before, the tables gain that run's seconds beside this one's (the slowest of either run, each file), and
--json writes both to a file.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def read(paths: list[str]) -> list[tuple[str, str, float]]:
    """(file, test id, seconds) per test case, setup and teardown included (junit's `total`)."""
    out = []
    for p in paths:
        for case in ET.parse(p).getroot().iter("testcase"):
            # classname is "tests.test_x" or, for a test in a class, "tests.test_x.TestY": the module's part
            parts = case.get("classname", "").split(".")
            file = next((p for p in reversed(parts) if p.startswith("test_")), parts[-1]) + ".py"
            out.append((file, f"{file}::{case.get('name')}", float(case.get("time", 0))))
    return out


def makespan(files: list[tuple[str, list[float]]], workers: int) -> float:
    """Finish time of xdist's loadfile schedule: a worker with two tests or fewer pending takes the next file."""
    queue = list(files)
    clocks = [0.0] * workers
    pending: list[list[float]] = [[] for _ in range(workers)]
    for w in range(workers):
        if queue:
            pending[w].extend(queue.pop(0)[1])
    while any(pending):
        w = min((i for i in range(workers) if pending[i]), key=lambda i: clocks[i])
        clocks[w] += pending[w].pop(0)
        if len(pending[w]) <= 2 and queue:
            pending[w].extend(queue.pop(0)[1])
    return max(clocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("junit", nargs="+")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--write", type=Path, help="the per-file seconds, for tests/conftest.py's order")
    ap.add_argument("--before", nargs="+", help="the junit XML of an earlier run, compared test by test")
    ap.add_argument("--json", type=Path, help="write the slowest tests and the files' seconds (both runs) here")
    args = ap.parse_args()
    cases = read(args.junit)
    if args.before:
        compare(read(args.before), cases, args.top, args.json)
        return
    per_file: dict[str, list[float]] = defaultdict(list)
    for file, _, s in cases:
        per_file[file].append(s)
    total = sum(s for *_, s in cases)
    print(f"{len(cases)} tests, {total:.0f} s in all, {len(per_file)} files\n")
    print(f"| slowest {args.top} | s |\n|---|---|")
    for _, name, s in sorted(cases, key=lambda c: -c[2])[: args.top]:
        print(f"| {name} | {s:.1f} |")
    print("\n| file | tests | s |\n|---|---|---|")
    for file, ts in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {file} | {len(ts)} | {sum(ts):.1f} |")
    by_count = sorted(per_file.items(), key=lambda kv: -len(kv[1]))
    by_seconds = sorted(per_file.items(), key=lambda kv: -sum(kv[1]))
    spans = {"xdist default (most tests first)": makespan(by_count, args.workers),
             "most seconds first": makespan(by_seconds, args.workers)}
    print(f"\n| order of files, {args.workers} workers | simulated wall s |\n|---|---|")
    for k, v in spans.items():
        print(f"| {k} | {v:.0f} |")
    print(f"| lower bound (all seconds / workers, or the longest file) | "
          f"{max(total / args.workers, max(sum(t) for t in per_file.values())):.0f} |")
    if args.write:
        args.write.write_text(json.dumps({f: round(sum(t), 1) for f, t in by_seconds}, indent=1) + "\n")
        print(f"\nwrote {args.write}")


def compare(before: list[tuple[str, str, float]], after: list[tuple[str, str, float]], top: int,
            out: Path | None) -> None:
    """The slowest `top` tests of either run, and every file, with both runs' seconds."""
    b, a = ({name: s for _, name, s in run} for run in (before, after))
    fb, fa = defaultdict(float), defaultdict(float)
    for run, acc in ((before, fb), (after, fa)):
        for file, _, s in run:
            acc[file] += s
    print(f"before: {len(b)} tests, {sum(b.values()):.0f} s in all; after: {len(a)} tests, {sum(a.values()):.0f} s\n")
    slow = sorted(set(b) | set(a), key=lambda n: -max(b.get(n, 0.0), a.get(n, 0.0)))[:top]
    print(f"| slowest {top} of either run | before s | after s |\n|---|---|---|")
    for n in slow:
        print(f"| {n} | {b.get(n, float('nan')):.1f} | {a.get(n, float('nan')):.1f} |")
    print("\n| file | before s | after s |\n|---|---|---|")
    for f in sorted(set(fb) | set(fa), key=lambda f: -max(fb.get(f, 0.0), fa.get(f, 0.0))):
        print(f"| {f} | {fb.get(f, 0.0):.1f} | {fa.get(f, 0.0):.1f} |")
    if out:
        files = {f: {"before_s": round(fb.get(f, 0.0), 1), "after_s": round(fa.get(f, 0.0), 1)}
                 for f in sorted(fb.keys() | fa.keys())}
        out.write_text(json.dumps({"total_s": {"before": round(sum(b.values()), 1), "after": round(sum(a.values()), 1)},
                                   "slowest": [{"test": n, "before_s": b.get(n), "after_s": a.get(n)} for n in slow],
                                   "files": files}, indent=1) + "\n")
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
