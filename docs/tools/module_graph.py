#!/usr/bin/env python3
"""Print the module layout of orchestrator/ as a Mermaid flowchart, generated from the code.

    python3 docs/tools/module_graph.py            # Mermaid text for docs/architecture.md
    python3 docs/tools/module_graph.py --check    # import circles and upward imports; exit 1 if any

Standard library only. Parses every orchestrator/**/*.py with `ast` (nothing is imported or run) and
collects its imports of orchestrator modules, the ones inside functions too (imports under
`if TYPE_CHECKING:` are annotations only, never run, and are left out). In the picture a
sub-package (launch/, ship/, ...) is one node that lists its modules, a top-level module is a node of its
own; nodes are grouped by layer (cli -> runner -> stages -> domain -> executors -> leaf). A solid arrow is
an import at module top, a dotted arrow an import made only inside a function (e.g. a stage's `apply`).

--check reports, per module: import circles (modules that import each other, directly or through
others, counting imports inside functions) and imports that go up the layer order, except the ones
ALLOWED lists (docs/architecture.md, "Layers").
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "orchestrator"
PKG = "orchestrator"

# Layer order, top to bottom. A node's layer is looked up by its first name under orchestrator/.
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    ("cli", "cli", ("cli", "__main__")),
    ("runner", "runner", ("runner",)),
    ("stages", "stages", ("stages",)),
    ("domain", "domain: launch, fabric, chain, ship, modelfetch, modelsync, imagechain, benchmark, monitor, router",
     ("launch", "fabric", "chain", "ship", "modelfetch", "modelsync", "imagechain", "benchmark", "monitor",
      "router")),
    ("executors", "executors", ("executors",)),
    ("hostside", "hostside: what runs on hosts (standard library only)", ("hostside",)),
    ("leaf", "leaf modules", ()),          # every other top-level module
]

# Upward imports the architecture allows: recipe and sizing compute table sizes with the pure,
# stdlib-only hostside.geometry (docs/architecture.md, "Layers").
ALLOWED = {
    ("orchestrator.recipe", "orchestrator.hostside.geometry"),
    ("orchestrator.sizing", "orchestrator.hostside.geometry"),
    # the inventory parses all.vars.router with the router's pure config module (no import of its own)
    ("orchestrator.inventory", "orchestrator.router.config"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(current: str, is_pkg: bool, level: int, mod: str | None) -> str:
    """The absolute name a (possibly relative) `from ... import` refers to."""
    if level == 0:
        return mod or ""
    base = current.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([mod] if mod else []))


def collect(root: Path = ROOT) -> tuple[dict[str, Path], dict[tuple[str, str], bool]]:
    """Modules, and edges (importer, imported) -> True when some import of it is at module level."""
    files = {module_name(p): p for p in sorted(root.rglob("*.py"))}
    edges: dict[tuple[str, str], bool] = {}

    def add(src: str, target: str, top: bool) -> None:
        # importing a.b.c means a.b.c if it is a module, else the nearest enclosing module
        while target and target not in files:
            target = target.rpartition(".")[0]
        if target and target != src and target != PKG:
            edges[(src, target)] = edges.get((src, target), False) or top

    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        top_level = {id(n) for n in tree.body}
        type_only: set[int] = set()
        for stmt in tree.body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                type_only.update(id(n) for n in ast.walk(stmt))      # annotations only: never run
            elif isinstance(stmt, (ast.If, ast.Try)):                # a top-level if/try still runs at import
                top_level.update(id(n) for n in ast.walk(stmt))
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            top = id(node) in top_level
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == PKG or a.name.startswith(PKG + "."):
                        add(name, a.name, top)
            elif isinstance(node, ast.ImportFrom):
                base = resolve(name, is_pkg, node.level, node.module)
                if not (base == PKG or base.startswith(PKG + ".")):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    add(name, sub if sub in files else base, top)
    return files, edges


def node_of(module: str) -> str:
    """The picture's node for a module: its sub-package, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(node: str) -> int:
    for i, (_, _, members) in enumerate(LAYERS):
        if node in members:
            return i
    return len(LAYERS) - 1


def mermaid(files: dict[str, Path], edges: dict[tuple[str, str], bool]) -> str:
    members: dict[str, list[str]] = {}
    for m, p in files.items():
        n = node_of(m)
        if n == "__init__":
            continue
        members.setdefault(n, [])
        if m.count(".") >= 2:                        # a module inside a sub-package: list it in the box
            members[n].append(m.split(".")[-1])
    is_package = {n for n in members if (ROOT / n).is_dir()}
    out = ["flowchart TB"]
    for i, (key, title, _) in enumerate(LAYERS):
        nodes = sorted(n for n in members if layer_of(n) == i)
        if not nodes:
            continue
        out.append(f'  subgraph L{i}_{key}["{title}"]')
        if key == "leaf":
            out.append("    direction LR")
        for n in nodes:
            if n in is_package:
                mods = sorted(members[n])
                rows, row = [], []
                for m in mods:                       # 4 module names a line keeps boxes narrow
                    row.append(m)
                    if len(row) == 4:
                        rows.append(" ".join(row)); row = []
                if row:
                    rows.append(" ".join(row))
                label = f"{n}/" + "".join(f"<br/>{r}" for r in rows)
            else:
                label = f"{n}.py"
            out.append(f'    {nid(n)}["{label}"]')
        out.append("  end")
    pairs: dict[tuple[str, str], bool] = {}
    for (a, b), top in edges.items():
        na, nb = node_of(a), node_of(b)
        if na != nb and "__init__" not in (na, nb):
            pairs[(na, nb)] = pairs.get((na, nb), False) or top
    for (a, b), top in sorted(pairs.items(), key=lambda e: (layer_of(e[0][0]), e[0][0], layer_of(e[0][1]), e[0][1])):
        out.append(f"  {nid(a)} {'-->' if top else '-.->'} {nid(b)}")
    return "\n".join(out)


def nid(node: str) -> str:
    return "m_" + node.strip("_")


def circles(files: dict[str, Path], edges: dict[tuple[str, str], bool]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {m: [] for m in files}
    for (a, b) in edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter; counter += 1
        stack.append(start); on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter; counter += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = []
                    while True:
                        w = stack.pop(); on.discard(w); scc.append(w)
                        if w == v:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
    return found


def check(files: dict[str, Path], edges: dict[tuple[str, str], bool]) -> int:
    bad = 0
    for scc in circles(files, edges):
        bad += 1
        print("import circle: " + ", ".join(scc))
        for (a, b) in sorted(edges):
            if a in scc and b in scc:
                print(f"    {a} -> {b}")
    for (a, b), top in sorted(edges.items()):
        la, lb = layer_of(node_of(a)), layer_of(node_of(b))
        if lb < la and (a, b) not in ALLOWED:
            bad += 1
            where = "module top" if top else "inside a function"
            print(f"upward import ({LAYERS[la][0]} -> {LAYERS[lb][0]}, {where}): {a} -> {b}")
    if not bad:
        print(f"no import circle, no upward import ({len(files)} modules, {len(edges)} import edges)")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    files, edges = collect()
    if argv[1:] == ["--check"]:
        return check(files, edges)
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    print(mermaid(files, edges))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
