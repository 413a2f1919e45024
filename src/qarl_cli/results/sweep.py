"""A sweep ends with its comparison: summary.md, summary.json and summary.png in the sweep directory, and the
tables on the console.

Hooked in as a Hydra callback (conf/train.yaml, hydra.callbacks) rather than after the launch in qarl_cli.cli.app:
Hydra calls on_multirun_end once every job has returned, with the sweep's config, whichever launcher ran the
jobs (in this process, or in others where this process never sees their return values); the summary reads
only what the jobs wrote into their directories."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


class SweepSummary(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) > 0:  # torchrun: rank 0 writes the run records
            return
        from qarl_cli.results.compare import compare, wide_console

        console = wide_console()
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        try:
            compare([sweep_dir], sweep_dir, f"qarl sweep {sweep_dir}", console)
        except Exception as e:  # noqa: BLE001 - the jobs' results are on disk; a failed summary must not hide them
            first = (str(e).strip().splitlines() or [""])[0]
            console.print(f"[qarl] sweep summary of {sweep_dir} not written ({type(e).__name__}: {first}); "
                          f"`qarl compare {sweep_dir}` writes it")
