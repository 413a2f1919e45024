"""`qarl plot DIR... [--out FILE]` and `qarl compare DIR... [--out DIR]`: they read directories that runs left
behind, so they take plain paths (argparse), not a Hydra config, and make no run directory of their own. Each DIR
is a run directory or a directory of runs (a sweep's). A path that is neither is one line, exit code 2."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from qarl_cli.results.runs import NotARun, is_run_dir

EXIT_USAGE = 2
FORMATS = (".png", ".pdf", ".svg", ".jpg")


def parser(command: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"qarl {command}", description=description)
    ap.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="a run directory, or a sweep's (its runs)")
    if command == "plot":
        ap.add_argument("--out", type=Path, help="the figure (default: DIR/curves.png for one DIR, else "
                                                 "./curves.png); its suffix picks the format")
    else:
        ap.add_argument("--out", type=Path, help="where summary.md, .json and .png go (default: the sweep "
                                                 "directory for one sweep, else compare/DATE/TIME/)")
    return ap


def main(command: str, argv: list[str], description: str = "") -> int:
    """description: the command's help line (qarl_cli.commands.TOOLS, which the caller holds)."""
    args = parser(command, description).parse_args(argv)  # a bad flag: argparse's usage line, exit code 2
    try:
        return plot(args.dirs, args.out) if command == "plot" else compare(args.dirs, args.out)
    except NotARun as e:
        print(f"qarl {command}: {e}", file=sys.stderr)
        return EXIT_USAGE


def plot(dirs: list[Path], out: Path | None) -> int:
    from qarl_cli.results import plot as curves
    from qarl_cli.results.runs import expand, read

    for d in dirs:  # the runs first: a missing run is what the user mistyped, not the figure's default place
        if not d.is_dir():
            raise NotARun(f"{d} does not exist or is not a directory")
    out = out or (dirs[0] / curves.CURVES if len(dirs) == 1 else Path(curves.CURVES))
    if out.suffix.lower() not in FORMATS:
        raise NotARun(f"--out {out}: a figure file is expected ({', '.join(FORMATS)})")
    if not out.parent.is_dir():
        raise NotARun(f"--out {out}: directory {out.parent} does not exist")
    found = [read(p) for p in expand(dirs)]
    if not any(r.rows for r in found):
        raise NotARun(f"{', '.join(map(str, dirs))}: no metrics logged yet (every metrics.jsonl is missing or empty)")
    drawn = curves.draw(found, out)
    print(f"[qarl] wrote {out} ({len(found)} run{'s' if len(found) > 1 else ''}): {', '.join(drawn)}")
    return 0


def compare(dirs: list[Path], out: Path | None) -> int:
    from qarl_cli.results.compare import compare as write, wide_console

    if out is None:
        single_sweep = len(dirs) == 1 and dirs[0].is_dir() and not is_run_dir(dirs[0])
        out = dirs[0] if single_sweep else Path("compare", time.strftime("%Y-%m-%d"), time.strftime("%H-%M-%S"))
    if is_run_dir(out):  # its summary.json is the run's own
        raise NotARun(f"--out {out} is a run directory; give the comparison a directory of its own")
    title = f"qarl compare {' '.join(map(str, dirs))}"
    write(dirs, out, title, wide_console())
    return 0
