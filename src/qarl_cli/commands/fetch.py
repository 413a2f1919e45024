"""`qarl fetch [names=[NAME,...]]`: fetch the registry assets (qarl_cli.assets.ASSETS) into the cache and build
the models made from them, ahead of the runs that would otherwise do it on first use: on a machine with network
for one without (copy $QARL_CACHE_DIR across), or before timing a run. Each name is an asset or an option built
from one (qarl_cli.assets.targets); an entry already cached is checked (every file's sha256), not fetched again.
Writes fetch.json in the run directory: each name, its source and where it lies."""

from __future__ import annotations

import json
from pathlib import Path

from qarl_cli.config.root import FetchConfig


def run(cfg: FetchConfig, run_dir: Path) -> int:
    from qarl_cli import assets
    from qarl_cli.config import data, model

    known = assets.targets()
    done = []
    for name in cfg.names or list(known):
        kind = known[name]
        if kind == "model":
            from qarl_cli.models.resolve import model_dir

            schema = model.SCHEMAS[name]
            where = [str(model_dir(schema()))]
            source = assets.ASSETS[schema.asset]
        elif kind == "data":
            from qarl_cli.data.packaged import packaged_files

            schema = data.SCHEMAS[name]
            where = list(packaged_files(schema()))
            source = assets.ASSETS[schema.packaged[0]]
        else:
            source = assets.ASSETS[name]
            where = [str(assets.ensure(name))]
        size = sum(f.stat().st_size for w in where for f in ([Path(w)] if Path(w).is_file() else Path(w).rglob("*"))
                   if f.is_file())
        print(f"[qarl] {kind} {name}: {source.registry} {source.spec} ({source.license}), {size / 2**20:.1f} MiB, "
              f"checked -> {', '.join(where)}")
        done.append({"name": name, "kind": kind, "source": source.source(), "paths": where, "bytes": size})
    (run_dir / "fetch.json").write_text(json.dumps(done, indent=2) + "\n")
    return 0
