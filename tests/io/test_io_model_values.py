"""JSON and YAML model data: every value of the tensor's dtype, or a `FormatError`.

numpy would turn ``null`` into NaN and ``true``/``2.7`` into int8 1/2; the loaders
refuse them, naming the file, the tensor and the value's position.
"""

import json

import numpy as np
import pytest
import yaml

from entrenar.errors import FormatError
from entrenar.io import (
    Model,
    ModelFormat,
    ModelMetadata,
    SaveConfig,
    load_model,
    save_model,
)


def _doc(dtype, shape, data):
    return {
        "format": "entrenar.model",
        "format_version": 1,
        "metadata": {"name": "m"},
        "tensors": {"enc.w": {"dtype": dtype, "shape": shape, "data": data}},
    }


def _write(tmp_path, doc, ext):
    path = tmp_path / f"m.{ext}"
    text = json.dumps(doc) if ext == "json" else yaml.safe_dump(doc)
    path.write_text(text)
    return str(path)


BAD = [
    ("float32", [2], [1.0, None], "value 1 (row-major) is null"),
    ("float32", [], None, "value 0 (row-major) is null"),
    ("float32", [2], [True, 1.0], "value 0 (row-major) is 'True' (bool)"),
    ("float32", [1], ["1.5"], "value 0 (row-major) is '1.5' (str)"),
    ("bfloat16", [1, 1], [[None]], "is null"),
    ("int8", [2], [1, True], "value 1 (row-major) is 'True' (bool)"),
    ("int8", [2], [1, 2.7], "value 1 (row-major) is '2.7' (float)"),
    ("int32", [1], ["nan"], "is 'nan' (str); dtype int32 holds only integers"),
    ("uint8", [1], [None], "is null"),
    ("bool", [2], [True, 1], "value 1 (row-major) is '1' (int)"),
    (["float32"], [1], [1.0], "dtype ['float32'] is not one of"),
    ({"a": 1}, [1], [1.0], "dtype {'a': 1} is not one of"),
]


@pytest.mark.parametrize("ext", ["json", "yaml"])
@pytest.mark.parametrize(("dtype", "shape", "data", "message"), BAD)
def test_values_of_the_wrong_kind_name_file_tensor_and_position(
    tmp_path, ext, dtype, shape, data, message
):
    path = _write(tmp_path, _doc(dtype, shape, data), ext)
    with pytest.raises(FormatError) as e:
        load_model(path)
    assert str(e.value).startswith(f"{path}: tensor 'enc.w'")
    assert message in str(e.value)


GOOD = [
    ("float32", [3], [1, 2.5, "nan"]),  # ints are exact floats; JSON's "nan" string
    ("float64", [2], ["inf", "-inf"]),
    ("int8", [2], [-128, 127]),
    ("uint64", [1], [2**64 - 1]),
    ("bool", [2], [True, False]),
]


@pytest.mark.parametrize("ext", ["json", "yaml"])
@pytest.mark.parametrize(("dtype", "shape", "data"), GOOD)
def test_values_of_the_dtype_load(tmp_path, ext, dtype, shape, data):
    got = load_model(_write(tmp_path, _doc(dtype, shape, data), ext)).params
    want = np.array([float(x) if isinstance(x, str) else x for x in data], dtype)
    np.testing.assert_array_equal(got["enc"]["w"], want)
    assert got["enc"]["w"].dtype == np.dtype(dtype)


@pytest.mark.parametrize("fmt", [ModelFormat.JSON, ModelFormat.YAML])
def test_every_dtype_entrenar_writes_reads_back(tmp_path, fmt):
    params = {
        "f": np.array([0.5, np.nan, -np.inf], np.float16),
        "i": np.array([[-1, 2]], np.int8),
        "u": np.array([7], np.uint32),
        "b": np.array([True, False]),
    }
    path = tmp_path / f"m.{fmt.value}"
    save_model(Model(ModelMetadata("m"), params), path, SaveConfig(fmt))
    back = load_model(path).params
    for k, v in params.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == v.dtype
