"""A summary (results.summary) as tables: rows of strings, rendered as markdown (summary.md) or as rich tables
on the console."""

from __future__ import annotations

from typing import Any, Optional

from qarl_cli.results.summary import METRICS

PERCENT = ("avg", "greedy", "pass")


def headers(k: Optional[int]) -> list[str]:
    at = f"@{k}" if k else "@k"
    return [f"avg{at} %", "greedy %", f"pass{at} %", "s/step", "k3_kl"]


def number(metric: str, value: Optional[float]) -> str:
    if value is None:
        return "-"
    if metric in PERCENT:
        return f"{100 * value:.1f}"
    return f"{value:.2e}" if metric == "k3_kl" else f"{value:.2f}"


def spread(metric: str, stats: Optional[dict]) -> str:
    if stats is None:
        return "-"
    return f"{number(metric, stats['mean'])} ± {number(metric, stats['std'])}"


def status(job: dict) -> str:
    return f"{job['status']}: {job['error']}" if job["error"] else job["status"]


def group_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = ["setting", "runs", "finished", *headers(summary["k"])]
    rows = [[" ".join(g["setting"]) or "(all)", str(len(g["runs"])), str(g["finished"]),
             *[spread(m, g[m]) for m in METRICS]] for g in summary["groups"]]
    return head, rows


def job_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = ["run", "overrides", "status", *headers(summary["k"])]
    common = summary["common_overrides"]
    rows = [[j["run"], " ".join(o for o in j["overrides"] if o not in common) or "-", status(j),
             *[number(m, j[m]) for m in METRICS]] for j in summary["jobs"]]
    return head, rows


def markdown(head: list[str], rows: list[list[str]]) -> str:
    cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731 - an override or an error may hold a pipe
    lines = ["| " + " | ".join(map(cell, head)) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows]) + "\n"


def markdown_summary(summary: dict, title: str, figure: Optional[str]) -> str:
    jobs = summary["jobs"]
    failed = [j for j in jobs if j["status"] != "finished"]
    common = " ".join(summary["common_overrides"])
    text = [f"# {title}\n", f"{len(jobs)} runs, {len(jobs) - len(failed)} finished"
            + (f", {len(failed)} not ({', '.join(j['run'] for j in failed)})" if failed else "") + "."
            + (f" Overrides of every run: `{common}`." if common else "") + "\n",
            "## By setting (mean ± std over the finished runs of each; the seed is not a setting)\n",
            markdown(*group_rows(summary)), "## Runs\n", markdown(*job_rows(summary)),
            "avg@k, greedy and pass@k: the last held-out evaluation of each run, in %; s/step: the mean of "
            "time/step; k3_kl: the mean of mismatch/k3_kl over the last third of the steps.\n"]
    if figure:
        text.append(f"![held-out accuracy by setting]({figure})\n")
    return "\n".join(text)


def print_summary(console: Any, summary: dict, title: str) -> None:
    from rich.table import Table

    for name, (head, rows) in ((f"{title}: by setting (mean ± std over seeds)", group_rows(summary)),
                               (f"{title}: runs", job_rows(summary))):
        table = Table(title=name)
        for i, h in enumerate(head):
            table.add_column(h, justify="right" if i >= len(head) - len(METRICS) else "left")
        for row in rows:
            table.add_row(*row)
        console.print(table)

