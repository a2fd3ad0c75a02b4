"""Imports run one way: no cycle between sub-packages, none between the modules of one package, and
nothing below the top imports the top. The same module check holds for benchmarks/ (a package too).

Every module of the package (gradspec/**/*.py, and kernels/, which ships as gradspec.kernels) is
parsed with ``ast``; each ``import gradspec.x...`` and ``from gradspec.x... import ...`` (relative
imports resolved) is an edge from the importing module's unit to the imported one's. A unit is a
sub-package (gradspec.<sub>) or a top-level module (gradspec, gradspec.__main__,
gradspec.environment). Imports inside functions (lazy ones) count, as do those under
``if TYPE_CHECKING:`` and ``importlib.import_module("gradspec.x...")`` with a literal prefix: a lazy
import still couples the two packages (one cannot be moved, tested or read without the other), it
only defers the cost, so it is reported as such ("inside a function") but not excused.

The top (gradspec/__init__.py, gradspec/__main__.py, gradspec/environment.py and gradspec.cli) may
import anything; nothing imports gradspec/__init__ or __main__, only the top imports
gradspec.environment, and only __main__ imports gradspec.cli (cli's own modules import each other
freely: that is within one unit).

Modules: an edge a -> b for each import a writes of b (``from pkg.x import name`` is an import of
pkg.x, ``from pkg import x`` of the module pkg.x where x is one), lazy and TYPE_CHECKING ones
included, for the reason above: a cycle of modules is one idea split across files that cannot be read
apart. Only the imports a module writes count, not the package __init__ files Python runs on the way:
``pkg/__init__`` importing pkg.a while pkg.a imports pkg.b is a chain (pkg -> pkg.a -> pkg.b), not a
cycle, so an __init__ that re-exports its modules makes none of them cyclic. A module that imports its
own package (``from pkg import name`` where name is re-exported there) while that __init__ imports
the module is a cycle (pkg -> pkg.a -> pkg): it reads a half-initialised package.
"""

from __future__ import annotations

import ast
import importlib.util
from collections import defaultdict
from pathlib import Path

import gradspec

REPO = Path(__file__).resolve().parents[1]
ROOT = "gradspec"
EXTENSIONS = {"gradspec._C"}  # built from csrc/ (optional: a checkout may lack it); it imports nothing
TOP = {"gradspec", "gradspec.__main__", "gradspec.environment", "gradspec.cli"}
# Which units may import each top unit (the others in TOP may be imported by no one below the top).
IMPORTERS = {"gradspec": set(), "gradspec.__main__": set(), "gradspec.environment": TOP,
             "gradspec.cli": {"gradspec.__main__"}}


def package_modules(root: str, dirs: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for each package prefix -> its folder (a package's __init__.py is the package)."""
    modules: dict[str, Path] = {}
    for prefix, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((prefix, *parts)).removesuffix(".__init__")
            modules.setdefault(name, path)
    return modules


def unit(module: str) -> str:
    """gradspec.<sub>.x -> gradspec.<sub>; gradspec -> gradspec."""
    return ".".join(module.split(".")[:2])


def _literal_prefix(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    return None


def imports_of(name: str, path: Path, known: set[str], root: str) -> list[tuple[str, int, str, bool]]:
    """(imported module, line, source, lazy) for each import of the package in one module."""
    source = path.read_text()
    tree = ast.parse(source, str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int, str, bool]] = []

    def target(base: str, attr: str | None) -> str:
        full = f"{base}.{attr}" if attr and base else (attr or base)
        return full if full in known else base

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, *([child.module] if child.module else [])])
                targets = [target(base, a.name) for a in child.names]
            elif (isinstance(child, ast.Call) and child.args
                  and (getattr(child.func, "attr", None) or getattr(child.func, "id", None)) == "import_module"):
                prefix = _literal_prefix(child.args[0])
                if prefix is not None:
                    prefix = prefix.rstrip(".")
                    while prefix and prefix not in known and "." in prefix:
                        prefix = prefix.rpartition(".")[0]
                    targets = [prefix]
            for t in dict.fromkeys(targets):
                if t == root or t.startswith(root + "."):
                    found.append((t, child.lineno, ast.get_source_segment(source, child) or "", inner))
            visit(child, inner)

    visit(tree, False)
    return found


def module_graph(
    root: str, dirs: dict[str, Path], extensions: set[str] = frozenset()
) -> dict[tuple[str, str], list[str]]:
    """(importing module, imported module) -> the import lines that make the edge (a module's imports of
    itself aside). extensions: compiled modules, so that ``from gradspec import _C`` is known for a module."""
    modules = package_modules(root, dirs)
    known = set(modules) | set(extensions)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, path in modules.items():
        for imported, line, text, lazy in imports_of(name, path, known, root):
            if imported != name:
                where = " (inside a function)" if lazy else ""
                edges[name, imported].append(f"{path}:{line}: {' '.join(text.split())}{where}")
    return dict(edges)


def import_graph(
    root: str, dirs: dict[str, Path], extensions: set[str] = frozenset()
) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the import lines that make the edge (between units only)."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for (a, b), lines in module_graph(root, dirs, extensions).items():
        if unit(a) != unit(b):
            edges[unit(a), unit(b)] += lines
    return dict(edges)


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) per strongly connected set of two or more nodes (units or modules)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for component in components:
        if len(component) < 2:
            continue
        start = min(component)
        paths = {start: [start]}  # shortest cycle through start, by breadth first within the component
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        found.append([*paths[last], start])
    return found


def describe(cycle: list[str], edges: dict[tuple[str, str], list[str]]) -> str:
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:], strict=False):
        lines.append(f"  {a} -> {b}:")
        lines += [f"    {line}" for line in edges[a, b]]
    return "\n".join(lines)


def gradspec_dirs() -> dict[str, Path]:
    dirs = {ROOT: Path(gradspec.__path__[0]).resolve()}
    # resolved: a worktree links gradspec/kernels to ../kernels, which rglob does not follow
    kernels = Path(importlib.util.find_spec("gradspec.kernels").submodule_search_locations[0]).resolve()
    if not kernels.is_relative_to(dirs[ROOT]):  # a checkout: kernels/ beside gradspec/ (package_dir)
        dirs[f"{ROOT}.kernels"] = kernels
    return dirs


def test_no_cycle_between_subpackages():
    edges = import_graph(ROOT, gradspec_dirs(), EXTENSIONS)
    assert ("gradspec.engine", "gradspec.linalg") in edges  # the walk sees the package
    assert any(a == "gradspec.linalg" and b == "gradspec.kernels" for a, b in edges)
    found = cycles(edges)
    assert not found, "import cycles between sub-packages:\n" + "\n".join(describe(c, edges) for c in found)


def test_no_cycle_between_modules():
    """Inside a sub-package too: every module of gradspec, lazy and TYPE_CHECKING imports included."""
    edges = module_graph(ROOT, gradspec_dirs(), EXTENSIONS)
    assert ("gradspec.alignment.capture", "gradspec.alignment.cosines") in edges  # the walk sees modules
    found = cycles(edges)
    assert not found, "import cycles between modules:\n" + "\n".join(describe(c, edges) for c in found)


def test_no_cycle_between_benchmark_modules():
    """benchmarks/ is a package (its scripts run as ``python -m benchmarks.<group>.<name>``): the same check."""
    edges = module_graph("benchmarks", {"benchmarks": REPO / "benchmarks"})
    assert ("benchmarks.gpu.gpu_suite", "benchmarks.gpu.cost_model") in edges  # the walk sees the package
    assert ("benchmarks.throughput.bench_score", "benchmarks.common") in edges
    found = cycles(edges)
    assert not found, "import cycles between benchmark modules:\n" + "\n".join(describe(c, edges) for c in found)


def test_nothing_below_the_top_imports_it():
    edges = import_graph(ROOT, gradspec_dirs(), EXTENSIONS)
    wrong = [f"{a} -> {b}:\n" + "\n".join(f"    {line}" for line in lines)
             for (a, b), lines in sorted(edges.items()) if b in IMPORTERS and a not in IMPORTERS[b]]
    assert not wrong, "imports of the top (gradspec, __main__, environment, cli):\n" + "\n".join(wrong)


def test_the_walk_finds_a_lazy_cycle_and_names_its_lines(tmp_path):
    """The checks themselves: a cycle made by a function-level import and a relative import is found."""
    pkg = tmp_path / "pkg"
    for folder, files in {"a": {"__init__.py": "", "one.py": "from pkg.b import two\n"},
                          "b": {"__init__.py": "", "two.py": "def f():\n    from ..c import three\n"},
                          "c": {"__init__.py": "", "three.py": "from pkg import a\n"}}.items():
        (pkg / folder).mkdir(parents=True)
        for name, text in files.items():
            (pkg / folder / name).write_text(text)
    (pkg / "__init__.py").write_text("")
    edges = import_graph("pkg", {"pkg": pkg})
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert edges["pkg.b", "pkg.c"] == [f"{pkg / 'b' / 'two.py'}:2: from ..c import three (inside a function)"]
    assert edges["pkg.c", "pkg.a"] == [f"{pkg / 'c' / 'three.py'}:1: from pkg import a"]


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_module_walk_finds_a_cycle_inside_one_package(tmp_path):
    """A cycle of three modules of one sub-package, closed by a TYPE_CHECKING import and a lazy relative
    one, is found with its lines; the sub-package graph does not see it."""
    pkg = _package(tmp_path / "pkg", {
        "__init__.py": "", "sub/__init__.py": "from pkg.sub.a import A\n",
        "sub/a.py": "from pkg.sub.b import B\nA = 1\n",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.c import C\nB = 2\n",
        "sub/c.py": "def f():\n    from . import a\n"})
    edges = module_graph("pkg", {"pkg": pkg})
    assert cycles(edges) == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.c", "pkg.sub.a"]]
    assert edges["pkg.sub.c", "pkg.sub.a"] == [f"{pkg / 'sub' / 'c.py'}:2: from . import a (inside a function)"]
    assert edges["pkg.sub.b", "pkg.sub.c"] == [f"{pkg / 'sub' / 'b.py'}:3: from pkg.sub.c import C"]
    assert cycles(import_graph("pkg", {"pkg": pkg})) == []  # one unit: the sub-package check misses it
    assert "pkg.sub.a -> pkg.sub.b -> pkg.sub.c -> pkg.sub.a" in describe(cycles(edges)[0], edges)


def test_an_init_that_re_exports_makes_no_module_cyclic(tmp_path):
    """pkg/__init__ importing pkg.a, which imports pkg.b, is a chain; a module that imports a name from
    its own package's __init__, which imports that module, is a cycle."""
    pkg = _package(tmp_path / "pkg", {"__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
                                      "a.py": "from pkg.b import B\nA = B\n", "b.py": "B = 1\n"})
    edges = module_graph("pkg", {"pkg": pkg})
    assert set(edges) == {("pkg", "pkg.a"), ("pkg", "pkg.b"), ("pkg.a", "pkg.b")} and cycles(edges) == []
    (pkg / "b.py").write_text("from pkg import A\nB = 1\n")
    assert cycles(module_graph("pkg", {"pkg": pkg})) == [["pkg", "pkg.b", "pkg"]]
