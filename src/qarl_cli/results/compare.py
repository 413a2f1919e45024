"""A comparison written out: summary.json (every number), summary.md (the tables) and summary.png (the curves
by setting) in one directory, and the tables on the console. The end of a sweep (results.sweep) and
`qarl compare` (results.cli) both come here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from qarl_cli.results import runs, summary, tables

SUMMARY_JSON, SUMMARY_MD, SUMMARY_PNG = "summary.json", "summary.md", "summary.png"


def write(found: list[runs.Run], out_dir: Path, title: str, warn: Callable[[str], None]) -> dict:
    """The three files; a figure that cannot be drawn is reported through `warn` in one line (the tables are
    the result, the figure a view of it)."""
    result = summary.summarise(found)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUMMARY_JSON).write_text(json.dumps({"title": title, **result}, indent=2) + "\n")
    (out_dir / SUMMARY_PNG).unlink(missing_ok=True)  # an earlier summary's figure would not match these tables
    drawn = False
    try:
        from qarl_cli.results.summary_plot import draw

        draw(found, result, out_dir / SUMMARY_PNG)
        drawn = True
    except Exception as e:  # noqa: BLE001 - see above
        warn(f"[qarl] {out_dir / SUMMARY_PNG} not drawn ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
    (out_dir / SUMMARY_MD).write_text(tables.markdown_summary(result, title, SUMMARY_PNG if drawn else None))
    return result


def compare(paths: list[Path], out_dir: Path, title: str, console: Any) -> dict:
    """Compare the runs that `paths` name (run or sweep directories) into out_dir; print the tables."""
    found = [runs.read(p) for p in runs.expand(paths)]
    result = write(found, out_dir, title, console.print)
    tables.print_summary(console, result, title)
    written = [n for n in (SUMMARY_MD, SUMMARY_JSON, SUMMARY_PNG) if (out_dir / n).is_file()]
    console.print(f"[qarl] wrote {', '.join(written)} in {out_dir}")
    return result


def wide_console() -> Any:
    """The console of the tables: wide enough for them when the output is a file (rich would use 80 columns)."""
    from rich.console import Console

    console = Console(markup=False, highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console.width = 200
    return console
