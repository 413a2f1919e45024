"""Where step metrics go. Every logger appends one JSON line per step to `<run dir>/metrics.jsonl` (the record
`qarl plot` draws); `logger=wandb` also sends the same keys and a table of sample completions to
Weights & Biases (offline unless configured otherwise: nothing leaves the machine by default)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class Logger(Protocol):
    """The logger stage's contract (`logger` group), built as impl(cfg, run_dir, config as a dict)."""

    def log(self, step: int, metrics: dict[str, float], samples: list[dict] | None = None) -> None:
        """One record per step (evaluations at a step without training log on their own)."""
        ...

    def close(self) -> None:
        ...


class JsonlLogger:
    def __init__(self, cfg: Any, run_dir: Path, config: dict) -> None:
        self.path = run_dir / cfg.metrics_file
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict[str, float], samples: list[dict] | None = None) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        pass


class WandbLogger(JsonlLogger):
    def __init__(self, cfg: Any, run_dir: Path, config: dict) -> None:
        super().__init__(cfg, run_dir, config)
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(run_dir),
                              config=config, name=run_dir.name)
        self.log_samples = cfg.log_samples

    def log(self, step: int, metrics: dict[str, float], samples: list[dict] | None = None) -> None:
        super().log(step, metrics, samples)
        data: dict[str, Any] = dict(metrics)
        if samples and self.log_samples:
            rows = samples[:self.log_samples]
            table = self.wandb.Table(columns=list(rows[0]))
            for row in rows:
                table.add_data(*row.values())
            data["samples"] = table
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class NullLogger:
    """The loggers of ranks other than 0 under torchrun: rank 0 logs the run."""

    def __init__(self, *args: Any) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float], samples: list[dict] | None = None) -> None:
        pass

    def close(self) -> None:
        pass
