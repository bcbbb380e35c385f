"""The layer diagram is true: every package imports only packages below it.

Reads every module's imports with `ast` (function-level imports included, so a
hidden upward import is caught too) and checks them against `LAYERS`, the diagram
of specs/conventions.md. Only the command line imports lazily (inside its commands,
so that ``entrenar --help`` starts without loading JAX). The graph of imports
between modules has no circle, but for autograd's: its tape and ops, engine and
tensor name each other's types under ``TYPE_CHECKING`` only, and
``Tensor.backward`` imports `entrenar.autograd.backward` when called.
"""

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "entrenar"

LAYERS = [
    {"errors", "types", "threads"},
    {"tree", "gradients", "native", "schema"},
    {"nn", "optim"},
    {"autograd", "quant"},
    {"io"},
    {"lora", "distill"},
    {"data", "merge", "distributed"},
    {"chat", "train"},
    {"preference"},
    {"config"},
    {"runs"},
    {"cli"},
    {"__init__", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
LAZY_ALLOWED = {"cli", "__init__", "__main__"}


def _imports(path: Path):
    """Yield ``(entrenar package imported, line, at module level)``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "entrenar":
                names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [
                a.name.split(".")[1]
                for a in node.names
                if a.name.startswith("entrenar.")
            ]
        for name in names:
            yield name, node.lineno, id(node) in top


def _package(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0][:-3] if len(parts) == 1 else parts[0]


def test_every_package_is_in_the_diagram():
    packages = {_package(p) for p in ROOT.rglob("*.py")}
    assert packages <= set(RANK), f"add {packages - set(RANK)} to LAYERS and the spec"


def test_no_upward_or_hidden_imports():
    upward, hidden = [], []
    for path in sorted(ROOT.rglob("*.py")):
        pkg = _package(path)
        for name, line, at_top in _imports(path):
            if name == pkg or name not in RANK:
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line} imports entrenar.{name}"
            if RANK[name] >= RANK[pkg]:
                upward.append(where)
            elif not at_top and pkg not in LAZY_ALLOWED:
                hidden.append(where)
    assert not upward, "imports that go up (or sideways) the layers:\n" + "\n".join(
        upward
    )
    assert not hidden, "imports hidden inside functions:\n" + "\n".join(hidden)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def _module_edges(path: Path):
    """Yield ``(module imported, at module level, under TYPE_CHECKING)``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    typing_only = {
        id(inner)
        for node in tree.body
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "entrenar"
        ):
            for a in node.names:  # a submodule by name, else the package itself
                sub = f"{node.module}.{a.name}"
                targets.append(sub if sub in MODULES else str(node.module))
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("entrenar.")]
        for target in targets:
            yield (
                target,
                id(node) in top or id(node) in typing_only,
                (id(node) in typing_only),
            )


def _import_graph(*, lazy: bool) -> dict[str, set[str]]:
    """Module -> the modules it imports (``lazy``: those inside functions too).

    autograd's own type-only and lazy imports of its modules are left out; every
    other import counts, those under ``TYPE_CHECKING`` included.
    """
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, at_top, type_only in _module_edges(path):
            exempt = name.startswith("entrenar.autograd") and target.startswith(
                "entrenar.autograd"
            )
            if target in MODULES and target != name and (at_top or lazy):
                if not (exempt and (type_only or not at_top)):
                    graph[name].add(target)
    return graph


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "all"])
def test_the_import_graph_has_no_circle(lazy):
    try:
        graphlib.TopologicalSorter(_import_graph(lazy=lazy)).prepare()
    except graphlib.CycleError as e:
        pytest.fail("an import circle: " + " -> ".join(e.args[1]))


def test_importing_entrenar_or_its_command_line_loads_no_jax():
    # `entrenar --help` must start at once: the top-level names are imported lazily
    code = (
        "import sys, entrenar, entrenar.cli; "
        "assert 'jax' not in sys.modules, [m for m in sys.modules if 'jax' in m]; "
        "from entrenar import Tensor, nn; assert 'jax' in sys.modules; "
        "assert entrenar.nn is nn and Tensor.__name__ == 'Tensor'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
