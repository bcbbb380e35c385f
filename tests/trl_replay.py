"""What the TRL replay tests (tests/preference/test_{dpo,grpo}_trl.py) share.

Each replays a TRL run recorded by tests/oracles/make_trl_{dpo,grpo}_reference.py:
a JSON of settings and metrics (``ref``) and an npz of arrays (``arr``) with the
starting weights ``init/<hf name>``, the LoRA run's starting adapter
``lora/init_adapter/<PEFT name>`` and each run's final weights
``<run>/final/<name>``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from entrenar import lora
from entrenar.nn import to_hf_names


def lora_start(
    arr: Any, ref: dict, tmp_path: Path, start_params: Callable[[], Any]
) -> Any:
    """The recorded starting adapter, loaded (a PEFT folder) onto ``start_params()``."""
    from safetensors.numpy import save_file

    folder = tmp_path / "adapter"
    folder.mkdir()
    prefix = "lora/init_adapter/"
    save_file({k[len(prefix) :]: arr[k] for k in arr.files if k.startswith(prefix)},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    (folder / "adapter_config.json").write_text(
        json.dumps(ref["lora"]["adapter_config"])
    )
    return lora.load_adapter(folder, start_params())


def assert_final_weights(arr: Any, run: str, params: Any, atol: float) -> None:
    """``params`` equal TRL's final weights of ``run`` (``lora``: the adapters).

    And TRL's steps moved them well beyond ``atol`` (so equality is not the start's).
    """
    prefix = f"{run}/final/"
    final = {k[len(prefix) :]: arr[k] for k in arr.files if k.startswith(prefix)}
    if run == "lora":
        ours = _peft_tensors(params)
        final = {k.replace(".default", ""): v for k, v in final.items()}
    else:
        ours = {k: np.asarray(v) for k, v in to_hf_names(params).items()}
    assert set(ours) == set(final)
    for k in final:
        np.testing.assert_allclose(ours[k], final[k], atol=atol, rtol=0, err_msg=k)
    moved = max(float(np.max(np.abs(final[k] - _start(arr, run, k)))) for k in final)
    assert moved > 1e-3  # the steps changed the weights well beyond the tolerance


def _start(arr: Any, run: str, key: str) -> np.ndarray:
    if run == "full":
        return arr[f"init/{key}"]
    init = {
        k.split("init_adapter/")[1]: arr[k] for k in arr.files if "init_adapter" in k
    }
    return init.get(
        key,
        np.zeros_like(arr[f"lora/final/{key.replace('.weight', '.default.weight')}"]),
    )


def _peft_tensors(params: Any) -> dict[str, np.ndarray]:
    """PEFT's adapter names ``base_model.model.<module>.lora_A.weight`` -> array."""
    out = {}
    for name, node in to_hf_names(params).items():
        if isinstance(node, lora.LoRAWeight):
            module = name[: -len(".weight")]
            out[f"base_model.model.{module}.lora_A.weight"] = np.asarray(node.a)
            out[f"base_model.model.{module}.lora_B.weight"] = np.asarray(node.b)
    return out
