"""Layers depend only downward, and no module imports itself back (docs/structure.md).

Every module of ``tiered_radix`` (and of the top-level ``kernels/`` folder, installed as
``tiered_radix.kernels``) is parsed, not imported: each ``import`` and ``from ... import`` in
it, module-level or inside a function, is an edge to the ``tiered_radix`` module it names.
Each module belongs to the unit of :data:`UNITS` whose name is its longest prefix; an edge may
go to the same unit or to a unit of a lower rank. Units of equal rank (the two adapters; the
simulator and the model fetcher) are independent of each other. The module graph must have no
cycle.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"tiered_radix": ROOT / "tiered_radix", "tiered_radix.kernels": ROOT / "kernels"}

# unit -> rank, bottom first; the rows of docs/structure.md's layer table
UNITS = {
    # language
    "tiered_radix.resources": 0,  # where the grammar and shipped policies are found
    "tiered_radix.policy": 1,
    "tiered_radix": 2,  # the package's front door (load_policy, ...)
    # storage formats: codecs and the TriZone layout, below both kernels and engine
    "tiered_radix.formats": 3,
    # kernels (Triton) and their PyTorch twins
    "tiered_radix.kernels": 4,
    # tier engine
    "tiered_radix.engine": 5,
    # adapters, independent of each other
    "tiered_radix.adapters": 6,
    "tiered_radix.adapters.transformers": 7,
    "tiered_radix.adapters.sglang": 7,
    # tools
    "tiered_radix.sim": 8,
    "tiered_radix.models": 8,
    "tiered_radix.eval": 9,
    "tiered_radix.cli": 10,
    "tiered_radix.__main__": 11,  # python -m tiered_radix: the CLI
}


def modules() -> dict[str, Path]:
    """Every module's dotted name -> its file (a package by its ``__init__.py``)."""
    out = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def imports(name: str, source: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The ``tiered_radix`` modules ``source`` (module ``name``) imports, anywhere in it:
    ``from X import y`` counts as ``X.y`` where that is a module, else as ``X``."""
    known = set(known)
    base = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[: len(base) - node.level + 1]
                target = ".".join(up + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m == "tiered_radix" or m.startswith("tiered_radix.")}


def unit(module: str) -> str:
    """The unit of :data:`UNITS` whose name is ``module``'s longest prefix."""
    best = ""
    for u in UNITS:
        if (module == u or module.startswith(u + ".")) and len(u) > len(best):
            best = u
    if not best:
        raise LookupError(f"{module} is in no unit of UNITS: add it (and to docs/structure.md)")
    return best


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Edges that go to a unit of the same or a higher rank (other than their own unit)."""
    bad = []
    for src, targets in sorted(graph.items()):
        u = unit(src)
        for dst in sorted(targets):
            v = unit(dst)
            if v != u and UNITS[v] >= UNITS[u]:
                bad.append(f"{src} -> {dst} ({u}, rank {UNITS[u]} -> {v}, rank {UNITS[v]})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@functools.cache
def _graph() -> tuple[tuple[str, frozenset[str]], ...]:
    mods = modules()
    return tuple(
        (name, frozenset(imports(name, path.read_text(), path.name == "__init__.py", mods)))
        for name, path in mods.items()
    )


def import_graph() -> dict[str, set[str]]:
    """module -> the ``tiered_radix`` modules it imports (a fresh copy: tests may edit it)."""
    return {name: set(targets) for name, targets in _graph()}


def test_every_module_is_in_a_unit():
    assert len(modules()) > 90  # the walk found the package (and kernels/)
    for name in modules():
        unit(name)


def test_layers_depend_only_downward():
    assert violations(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_kernel_layout_is_below_engine_and_kernels():
    """The storage formats import nothing of the package but each other."""
    graph = import_graph()
    for name, targets in graph.items():
        if unit(name) == "tiered_radix.formats":
            assert {unit(t) for t in targets} <= {"tiered_radix.formats"}, (name, targets)


@pytest.mark.parametrize(
    ("module", "line", "why"),
    [
        ("tiered_radix.kernels.quant", "from tiered_radix.engine.store import TierStore",
         "kernels -> engine"),
        ("tiered_radix.adapters.sglang.backend",
         "from tiered_radix.adapters.transformers.cache import TieredCache", "adapter -> adapter"),
        ("tiered_radix.eval.kvpress_run", "from ..cli.eval import UsageError", "eval -> cli"),
        ("tiered_radix.formats.layout", "from tiered_radix.kernels import decode",
         "formats -> kernels"),
        ("tiered_radix.engine.ledger", "def f():\n    from ..adapters.sglang import pool",
         "a lazy import counts"),
    ],
)  # fmt: skip
def test_an_upward_import_is_caught(module, line, why):
    """The checks fail on the imports this layout removed (each added back to its module)."""
    mods = modules()
    graph = import_graph()
    source = mods[module].read_text() + "\n" + line + "\n"
    graph[module] = imports(module, source, False, mods)
    assert any(v.startswith(f"{module} -> ") for v in violations(graph)), why


def test_a_cycle_is_caught():
    """Two eval modules importing each other (as ``tasks`` and its generators did)."""
    mods = modules()
    graph = import_graph()
    src = mods["tiered_radix.eval.sample"].read_text() + "\nfrom . import counting\n"
    graph["tiered_radix.eval.sample"] = imports("tiered_radix.eval.sample", src, False, mods)
    assert ["tiered_radix.eval.counting", "tiered_radix.eval.sample"] in cycles(graph)
