"""The dose-response study: its record survives being grown one leg at a time, and it compares each arm with
naive seed by seed.

scripts/dose_response.py is grown over several invocations into one out-dir; its JSON is the record that lets a
later invocation read a run back instead of training it again. An invocation whose plan covers one leg must keep
the other legs' runs in that JSON: before this was so, tabulating the 8-bit leg into the study's out-dir dropped
every other run from the JSON, and the next invocation retrained them (on another CPU kind, so with other samples).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "docs" / "dose_response.json"


def key(run: dict) -> tuple:
    return run["regime"], run["arm"], run["bits"], run.get("group"), run["seed"]


def test_tabulating_one_leg_keeps_the_other_legs_in_the_record(tmp_path):
    shutil.copy(STUDY, tmp_path / "dose_response.json")
    before = json.loads(STUDY.read_text())
    leg = [r for r in before["runs"] if r["bits"] == 8 and r["regime"] == "on" and r["arm"] in ("naive", "qarl")]
    assert leg and len(leg) < len(before["runs"])  # the committed study has this leg and others
    # --finished-only trains nothing; with an empty runs dir every run of the plan is read back from the record
    subprocess.run([sys.executable, "scripts/dose_response.py", "--finished-only", "--bits", "8", "--regimes", "on",
                    "--arms", "naive,qarl", "--seeds", "3", "--runs-dir", str(tmp_path / "no_runs"),
                    "--out-dir", str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    after = json.loads((tmp_path / "dose_response.json").read_text())
    assert sorted(map(key, after["runs"])) == sorted(map(key, before["runs"]))
    # the table covers the plan only, and reads the leg's runs back to the committed figures
    assert {(r["regime"], r["dose"], r["arm"]) for r in after["rows"]} == {("on", "8-bit", "naive"),
                                                                           ("on", "8-bit", "qarl")}
    committed = {(r["regime"], r["dose"], r["arm"]): r for r in before["rows"]}
    for row in after["rows"]:
        assert row == committed[row["regime"], row["dose"], row["arm"]]
    kept = len(before["runs"]) - len(leg)
    assert f"the JSON also keeps {kept} recorded runs outside this plan" in after["scale"]


def test_each_arm_is_compared_with_naive_seed_by_seed(tmp_path):
    shutil.copy(STUDY, tmp_path / "dose_response.json")
    runs = json.loads(STUDY.read_text())["runs"]
    subprocess.run([sys.executable, "scripts/dose_response.py", "--finished-only", "--bits", "4,3g16", "--regimes",
                    "on,off", "--arms", "naive,naive+tis,qarl,bf16", "--seeds", "3", "--runs-dir",
                    str(tmp_path / "no_runs"), "--out-dir", str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    pairs = json.loads((tmp_path / "dose_response.json").read_text())["paired"]
    final = {key(r): 100 * r["last"]["eval/avg@4"] for r in runs}
    start = {key(r): r["first"]["eval/avg@4"] for r in runs}
    expected = set()
    for regime in ("on", "off"):
        for bits, group, dose in ((4, None, "4-bit"), (3, 16, "3-bit g16")):
            for arm in ("naive+tis", "qarl", "bf16"):
                own = (0, None) if arm == "bf16" else (bits, group)
                seeds = [s for s in range(3) if (regime, arm, *own, s) in final and (regime, "naive", bits, group, s)
                         in final]
                if not seeds:
                    continue  # a cell the committed study has not run
                diffs = [final[regime, arm, *own, s] - final[regime, "naive", bits, group, s] for s in seeds]
                same = sum(start[regime, arm, *own, s] == start[regime, "naive", bits, group, s] for s in seeds)
                expected.add((regime, dose, arm, len(seeds), ", ".join(f"{d:+.1f}" for d in diffs),
                              f"{sum(d > 1e-9 for d in diffs)} / {sum(abs(d) <= 1e-9 for d in diffs)} / "
                              f"{sum(d < -1e-9 for d in diffs)}", "-" if arm == "bf16" else f"{same} of {len(seeds)}"))
    got = {(p["regime"], p["dose"], p["arm"], p["seeds"], p["minus naive, by seed"], p["ahead / level / behind"],
            p["same start"]) for p in pairs}
    assert got == expected
    assert any(p["arm"] == "qarl" for p in pairs) and any(p["arm"] == "bf16" for p in pairs)
