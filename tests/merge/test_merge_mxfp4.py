"""Merging gpt-oss folders whose experts are the Hub's MXFP4 (`io.hf_mxfp4`).

openai/gpt-oss-20b, the base of every gpt-oss fine-tune, stores its experts as
MXFP4 blocks and scales; fine-tunes are mostly float folders. A merge reads each
MXFP4 pair as its float stack and writes the merged stacks in the base's layout
(MXFP4 again, with the base's config.json), streamed or in memory alike.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
import safetensors.numpy

from entrenar import io, merge, nn
from entrenar.errors import FormatError
from entrenar.nn.mxfp4 import dequantize_hf, quantize_hf
from entrenar.tree import tree_named_leaves

CONFIG = dataclasses.replace(
    nn.architecture("gpt_oss").tiny(), hidden_size=64, intermediate_size=64
)  # rows of whole 32-value blocks


def _folders(tmp_path):
    """An MXFP4 base folder and a float (bfloat16) fine-tune of the same model."""
    a, b = tmp_path / "base", tmp_path / "tuned"
    io.save_hf_folder(a, CONFIG, CONFIG.init(jax.random.key(0)), dtype="bfloat16",
                      expert_type="MXFP4")  # fmt: skip
    io.save_hf_folder(b, CONFIG, CONFIG.init(jax.random.key(1)), dtype="bfloat16")
    return a, b


def _linear(first, second, out, stream=True):
    recipe = {
        "merge_method": "linear",
        "models": [{"model": str(first), "parameters": {"weight": 0.5}},
                   {"model": str(second), "parameters": {"weight": 0.5}}],
        "dtype": "float32",
    }  # fmt: skip
    merge.run_recipe(recipe, out, stream=stream)
    return dict(tree_named_leaves(io.load_hf_folder(out, dtype="float32")[1]))


def _mean(a, b):
    la = dict(tree_named_leaves(io.load_hf_folder(a, dtype="float32")[1]))
    lb = dict(tree_named_leaves(io.load_hf_folder(b, dtype="float32")[1]))
    return {k: 0.5 * (np.asarray(la[k]) + np.asarray(lb[k])) for k in la}


def _is_stack(name):
    return ".experts." in name and name.endswith("_proj.weight")


@pytest.mark.parametrize("stream", [True, False])
def test_an_mxfp4_base_and_a_float_fine_tune_merge_to_an_mxfp4_folder(stream, tmp_path):
    a, b = _folders(tmp_path)
    got = _linear(a, b, tmp_path / "out", stream)
    want = _mean(a, b)
    stacks = [k for k in want if _is_stack(k)]
    assert len(stacks) == 3
    for name, value in want.items():
        if _is_stack(name):  # the mean, quantized along `in` as the folder stores it
            value = dequantize_hf(*quantize_hf(value))
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["quantization_config"]["quant_method"] == "mxfp4"
    stored = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert stored["model.layers.0.mlp.experts.down_proj_blocks"].dtype == np.uint8
    assert "model.layers.0.mlp.experts.down_proj" not in stored


def test_a_float_base_takes_an_mxfp4_model_as_floats(tmp_path):
    a, b = _folders(tmp_path)
    got = _linear(b, a, tmp_path / "out")
    for name, value in _mean(a, b).items():
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)
    stored = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert stored["model.layers.0.mlp.experts.down_proj"].dtype == np.float32
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in hf


def test_blocks_without_their_scales_are_named(tmp_path):
    a, b = _folders(tmp_path)
    file = a / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(file))
    del tensors["model.layers.1.mlp.experts.gate_up_proj_scales"]
    safetensors.numpy.save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"gate_up_proj has MXFP4 blocks without"):
        _linear(a, b, tmp_path / "out")


@pytest.mark.parametrize(
    ("key", "change", "match"),
    [  # the first two merged into NaN / infinite experts; the last named no file
        ("down_proj_scales", lambda t: np.full_like(t, 255), "the byte 255: E8M0"),
        ("gate_up_proj_scales", lambda t: np.full_like(t, 254), "the byte 254"),
        ("down_proj_blocks", lambda t: t.view(np.int8), r"down_proj_blocks \(.*int8"),
    ],
)
def test_mxfp4_bytes_that_are_no_weights_are_refused_by_file(
    tmp_path, key, change, match
):
    a, b = _folders(tmp_path)
    file = a / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(file))
    name = f"model.layers.1.mlp.experts.{key}"
    tensors[name] = change(tensors[name])
    safetensors.numpy.save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(FormatError, match=rf"{a}: model\.layers\.1.*{match}"):
        _linear(b, a, tmp_path / "out")
