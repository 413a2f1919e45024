"""The dose-response study's record survives being grown one leg at a time.

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
    leg = [r for r in before["runs"] if r["bits"] == 8 and r["regime"] == "on"]
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
