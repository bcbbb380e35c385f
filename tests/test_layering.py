"""The layer diagram is true: every package imports only packages below it.

Reads every module's imports with `ast` (function-level imports included, so a
hidden upward import is caught too) and checks them against `LAYERS`, the diagram
of specs/conventions.md. Only the command line imports lazily (inside its commands,
so that ``entrenar --help`` starts without loading JAX).
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1] / "entrenar"

LAYERS = [
    {"errors", "types"},
    {"tree", "gradients", "native"},
    {"nn", "optim"},
    {"autograd", "quant"},
    {"io"},
    {"lora", "distill"},
    {"data", "merge", "distributed"},
    {"chat", "train"},
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


def test_importing_entrenar_or_its_command_line_loads_no_jax():
    # `entrenar --help` must start at once: the top-level names are imported lazily
    code = (
        "import sys, entrenar, entrenar.cli; "
        "assert 'jax' not in sys.modules, [m for m in sys.modules if 'jax' in m]; "
        "from entrenar import Tensor, nn; assert 'jax' in sys.modules; "
        "assert entrenar.nn is nn and Tensor.__name__ == 'Tensor'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
