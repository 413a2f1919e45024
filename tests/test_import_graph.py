"""The package's modules, and its packages (every module folded into its top-level package), import each other
without a circle (scripts/import_graph.py reads every import, lazy ones
included, from the source); the checker itself finds a planted circle, lazy or relative."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


def _checker():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_module_imports_itself_through_others():
    g = _checker()
    edges = g.graph("modules")
    assert len(edges) > 50  # it read the package, not an empty tree
    assert g.circles(edges) == []


def test_no_package_imports_itself_through_others():
    # A stage's package may use config, machine and the shared modules, never reach back into a package that
    # uses it: e.g. config's Hydra help reads qarl_cli.config.usage, not the commands package (which reaches every stage).
    g = _checker()
    edges = g.graph("packages")
    nodes = set(edges) | {target for targets in edges.values() for target in targets}
    assert {"config", "rollout", "sync", "quant", "commands", "update", "forward", "machine"} <= nodes
    assert g.circles(edges) == []


def test_the_checker_finds_a_lazy_and_a_relative_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub.b import g  # lazy\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")  # relative, to the module a
    (pkg / "c.py").write_text("import pkg.a\n")  # into the circle, not part of it
    g = _checker()
    edges = g.graph("modules", tmp_path, "pkg")
    assert edges["pkg.c"] == {"pkg.a"}
    assert g.circles(edges) == [["pkg.a", "pkg.sub.b"]]
