"""The package's import graph, read from the source (every `import` and `from ... import` of a qarl_cli module,
at module level or inside a function: a lazy import is still a dependency), and its circles.

    .venv/bin/python scripts/import_graph.py [--level modules|packages] [--json FILE]

modules: an edge per importing module -> imported module (a circle here is two modules that need each other);
packages: modules folded into their first-level package (qarl_cli.rollout.vllm_engine -> rollout), the rooms of
docs/design.md's layout. Prints each level's size and its circles (strongly connected components of more than one
node), and exits 1 when there is one."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "qarl_cli"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, modules: set[str], root: Path = ROOT, package: str = PACKAGE) -> set[str]:
    """The `package` modules `path` imports (a `from pkg import name` counts as pkg.name when that is a module)."""
    me = module_name(path, root)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                anchor = me.split(".")[: len(me.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != me and name.split(".")[0] == package:
                out.add(name)
    return out


def graph(level: str, root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    edges: dict[str, set[str]] = {}
    for f in files:
        src = module_name(f, root)
        for dst in imports(f, modules, root, package):
            if level == "packages":
                a, b = fold(src), fold(dst)
                if a != b:
                    edges.setdefault(a, set()).add(b)
            else:
                edges.setdefault(src, set()).add(dst)
    return edges


def fold(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", choices=["modules", "packages", "both"], default="both")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    report = {}
    for level in (["modules", "packages"] if args.level == "both" else [args.level]):
        edges = graph(level)
        found = circles(edges)
        nodes = set(edges) | {w for ws in edges.values() for w in ws}
        report[level] = {"nodes": len(nodes), "edges": sum(map(len, edges.values())), "circles": found}
        print(f"{level:9s} {len(nodes):4d} nodes {report[level]['edges']:5d} edges  circles: {len(found)}")
        for c in found:
            print("   " + " <-> ".join(c))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(r["circles"] for r in report.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
