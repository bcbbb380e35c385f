"""pyproject.toml in the form current packaging tools take without warnings."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def test_license_is_an_spdx_string_and_setuptools_knows_it():
    """A ``{text = ...}`` table made setuptools print a deprecation banner per build."""
    doc = tomllib.loads(PYPROJECT.read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in doc["build-system"]["requires"]  # PEP 639 support


def test_the_suite_tools_are_declared():
    """`make test` runs pytest-xdist workers sharing a filelock-guarded JAX cache."""
    dev = " ".join(
        tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["dev"]
    )
    assert "pytest-xdist" in dev and "filelock" in dev


def test_make_test_oldest_runs_the_jax_minimum_pyproject_names():
    """`make test-oldest` checks the version the dependency pins say works."""
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    makefile = (PYPROJECT.parent / "Makefile").read_text()
    oldest = re.search(r"^OLDEST_JAX := (\S+)$", makefile, re.M)
    assert oldest, "Makefile: OLDEST_JAX is gone"
    assert f"jax>={oldest.group(1)}" in deps and f"jaxlib>={oldest.group(1)}" in deps
