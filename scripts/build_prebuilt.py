"""Build the tiny models that ship with qarl (qarl_cli/models/prebuilt/), from their default recipes.

A first `qarl train` copies the shipped build of its recipe instead of running a warm start of minutes
(qarl_cli.models.tiny). Run this after changing a tiny model's recipe (its cache key changes, and
tests/test_tiny_model.py fails until a build for the new key ships); each model is built from scratch in a
temporary cache, then replaces the shipped directory of its key, and older keys of the same model are removed.

    .venv/bin/python scripts/build_prebuilt.py [--names tiny_arith,tiny_moe]

Prints a table (name, key, warm-start steps, held-out greedy accuracy, build seconds, size) and writes nothing else."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

from _bench import markdown


def main() -> None:
    from qarl_cli.config.model import SCHEMAS
    from qarl_cli.models.tiny import BUILD_MARKER, PREBUILT, cache_path, ensure_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--names", default="tiny_arith,tiny_moe")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="qarl-prebuilt-") as tmp:
        for name in args.names.split(","):
            cfg = dataclasses.replace(SCHEMAS[name](), cache_dir=tmp, prebuilt=False)  # a real build, here
            built = ensure_tiny_model(cfg, log=print)
            dest = PREBUILT / cache_path(dataclasses.replace(cfg, prebuilt=True)).name
            for old in PREBUILT.glob(f"{name}-*"):
                shutil.rmtree(old)
            shutil.copytree(built, dest)
            info = json.loads((dest / BUILD_MARKER).read_text())
            warm = info.get("warm_start") or {}
            rows.append({"name": name, "key": dest.name, "steps": warm.get("steps"),
                         "heldout_greedy": warm.get("heldout_accuracy"), "seconds": info.get("build_seconds"),
                         "MB": round(sum(f.stat().st_size for f in dest.iterdir()) / 2**20, 2)})
    print(markdown(rows))


if __name__ == "__main__":
    main()
