"""save_model / load_model round trips for every format and dtype; safetensors; HF."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from entrenar.errors import EntrenarError, FormatError, UnsupportedError
from entrenar.io import (
    Model,
    ModelFormat,
    ModelMetadata,
    SaveConfig,
    detect_format,
    load_model,
    read_safetensors,
    save_model,
)

EXT = {
    ModelFormat.JSON: "json",
    ModelFormat.YAML: "yaml",
    ModelFormat.SAFETENSORS: "safetensors",
    ModelFormat.GGUF: "gguf",
}
FLOATS = ["float32", "float16", "bfloat16", "float64"]
INTS = ["int8", "int16", "int32", "int64"]
UINTS = ["uint8", "uint16", "uint32", "uint64", "bool"]


def _array(rng, dtype, shape):
    if dtype in FLOATS:
        x = rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6, size=shape)
        return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def _model(dtypes, shapes=((2, 3), (4,), (1, 2, 2))):
    rng = np.random.default_rng(0)
    params = {
        "layer": {
            f"w_{d}": _array(rng, d, shapes[i % len(shapes)])
            for i, d in enumerate(dtypes)
        },
        "head": {"bias": np.array([1.5, -0.0, 3e-38], np.float32)},
    }
    meta = (
        ModelMetadata("tiny", "mlp", training_config={"lr": 0.001, "steps": [1, 2]})
        .with_version("1.2.3")
        .with_custom(seed=7, note="ü")
    )
    return Model(meta, params)


def _assert_same(a, b):
    assert a.metadata == b.metadata
    fa = {k: np.asarray(v) for k, v in _flat(a.params).items()}
    fb = {k: np.asarray(v) for k, v in _flat(b.params).items()}
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
        np.testing.assert_array_equal(fa[k].view(np.uint8), fb[k].view(np.uint8), k)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("fmt", list(ModelFormat))
@pytest.mark.parametrize("pretty", [False, True])
def test_round_trip_is_exact(tmp_path, fmt, pretty):
    dtypes = FLOATS + INTS + ([] if fmt == ModelFormat.GGUF else UINTS)
    model = _model(dtypes)
    path = tmp_path / f"m.{EXT[fmt]}"
    save_model(model, path, SaveConfig(fmt, pretty=pretty))
    assert detect_format(path) == fmt
    _assert_same(load_model(path), model)


def test_safetensors_keeps_a_scalar_leaf_0_d(tmp_path):
    """save_safetensors went through np.ascontiguousarray, which returns at least 1-d.

    A 0-d leaf (a learned scalar) came back with shape (1,); JSON, YAML and the
    streamed writer keep ().
    """
    path = tmp_path / "m.safetensors"
    save_model(Model(ModelMetadata(), {"s": np.float32(2.5)}), path)
    back = load_model(path).params["s"]
    assert back.shape == () and back == 2.5


def test_safetensors_bytes_do_not_depend_on_the_call(tmp_path):
    """The same model saved twice is the same file, read by the safetensors package.

    The ``safetensors`` package writes ``__metadata__`` from a Rust ``HashMap``, in
    an order that changed from call to call: a run and its resumed copy (or two
    runs of one config) wrote different model files of equal tensors. Found by
    tests/runs/test_cli_kill_resume.py.
    """
    from safetensors import safe_open

    model = Model(
        ModelMetadata(name="m", architecture="mlp", custom={"a": 1, "b": [2]}),
        {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "i": np.int8(3)},
    )
    files = []
    for i in range(12):
        save_model(model, tmp_path / f"{i}.safetensors")
        files.append((tmp_path / f"{i}.safetensors").read_bytes())
    assert len(set(files)) == 1
    with safe_open(tmp_path / "0.safetensors", "np") as f:
        assert len(f.metadata()) >= 4 and f.metadata()["name"] == "m"
        np.testing.assert_array_equal(f.get_tensor("w"), model.params["w"])
        assert f.get_tensor("i") == 3


def test_json_writes_non_finite_bfloat16_as_strings(tmp_path):
    """bfloat16 Inf/NaN are "inf"/"nan" in JSON, as for the other float dtypes.

    The writer tested ``dtype.kind == "f"``, which bfloat16 (kind "V") fails, so
    json.dump raised a bare ValueError; the reader then parsed the strings in
    bfloat16, which cannot read them.
    """
    bf = np.array([np.inf, -np.inf, np.nan, 1.5], np.float32).astype(ml_dtypes.bfloat16)
    path = tmp_path / "m.json"
    save_model(Model(ModelMetadata(), {"b": bf}), path, SaveConfig(ModelFormat.JSON))
    assert json.loads(path.read_text())["tensors"]["b"]["data"][:2] == ["inf", "-inf"]
    back = load_model(path).params["b"]
    assert back.dtype == bf.dtype
    np.testing.assert_array_equal(back.astype(np.float32), bf.astype(np.float32))


@pytest.mark.parametrize("fmt", [ModelFormat.JSON, ModelFormat.YAML])
def test_text_formats_keep_shapes_and_non_finite(tmp_path, fmt):
    w = np.array([[np.nan, np.inf], [-np.inf, -0.0]], np.float32)
    model = Model(ModelMetadata(), {"w": w, "s": np.float32(2.5)})
    path = tmp_path / f"m.{EXT[fmt]}"
    save_model(model, path, SaveConfig(fmt))
    if fmt == ModelFormat.JSON:
        doc = json.loads(path.read_text())
        assert doc["tensors"]["w"]["shape"] == [2, 2]
        assert doc["tensors"]["w"]["data"][0] == ["nan", "inf"]
        assert doc["tensors"]["s"] == {"dtype": "float32", "shape": [], "data": 2.5}
    back = load_model(path)
    np.testing.assert_array_equal(back.params["w"], w)
    assert np.signbit(back.params["w"][1, 1]) and back.params["s"].shape == ()


def test_jax_arrays_save(tmp_path):
    model = Model(ModelMetadata(), {"w": jnp.arange(6.0).reshape(2, 3)})
    save_model(model, tmp_path / "m.safetensors")
    np.testing.assert_array_equal(
        load_model(tmp_path / "m.safetensors").params["w"], np.arange(6.0).reshape(2, 3)
    )


def test_bare_params_tree_saves_with_default_metadata(tmp_path):
    save_model({"w": np.ones((2, 3), np.float32)}, tmp_path / "m.safetensors")
    back = load_model(tmp_path / "m.safetensors")
    assert back.metadata == ModelMetadata()
    np.testing.assert_array_equal(back.params["w"], np.ones((2, 3)))
    with pytest.raises(TypeError, match=r"Model or a params tree.*not ndarray"):
        save_model(np.ones(3), tmp_path / "x.safetensors")


def test_safetensors_is_readable_by_safetensors_and_torch(tmp_path):
    import safetensors.numpy
    import safetensors.torch
    import torch

    model = _model(["float32", "bfloat16", "int64"])
    path = tmp_path / "m.safetensors"
    save_model(model, path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))["__metadata__"]
    assert meta["name"] == "tiny" and json.loads(meta["custom"])["seed"] == 7
    ref = safetensors.torch.load_file(path)
    ours, _ = read_safetensors(path)
    for k, t in ref.items():
        if t.dtype == torch.bfloat16:
            t = t.float()
            np.testing.assert_array_equal(ours[k].astype(np.float32), t.numpy())
        else:
            np.testing.assert_array_equal(ours[k], t.numpy())
    # A file written by the safetensors package (no entrenar metadata) loads too.
    safetensors.numpy.save_file({"a.b": np.ones((2, 2), np.float32)}, tmp_path / "x.st")
    m = load_model(tmp_path / "x.st")
    assert m.metadata == ModelMetadata() and m.params["a"]["b"].shape == (2, 2)


@pytest.mark.parametrize(
    "name, fmt",
    [("m.json", ModelFormat.JSON), ("m.YML", ModelFormat.YAML),
     ("m.yaml", ModelFormat.YAML), ("m.gguf", ModelFormat.GGUF),
     ("m.safetensors", ModelFormat.SAFETENSORS), ("m.bin", ModelFormat.SAFETENSORS)],
)  # fmt: skip
def test_without_a_config_the_extension_names_the_format(name, fmt, tmp_path):
    """``save_model(m, "m.json")`` writes JSON (it wrote safetensors bytes before)."""
    model = _model(["float32"])
    save_model(model, tmp_path / name)
    assert detect_format(tmp_path / name) == fmt
    np.testing.assert_array_equal(
        load_model(tmp_path / name).params["head"]["bias"], model.params["head"]["bias"]
    )


def test_detect_format_by_magic_over_extension(tmp_path):
    model = _model(["float32"])
    save_model(model, tmp_path / "m.bin", SaveConfig(ModelFormat.GGUF))
    assert detect_format(tmp_path / "m.bin") == ModelFormat.GGUF
    save_model(model, tmp_path / "m.gguf", SaveConfig(ModelFormat.JSON))
    assert detect_format(tmp_path / "m.gguf") == ModelFormat.JSON
    save_model(model, tmp_path / "m.dat", SaveConfig(ModelFormat.SAFETENSORS))
    assert detect_format(tmp_path / "m.dat") == ModelFormat.SAFETENSORS
    (tmp_path / "m.xyz").write_bytes(b"\x00\x01")
    with pytest.raises(FormatError, match=r"m\.xyz"):
        load_model(tmp_path / "m.xyz")


def test_invalid_models_are_rejected(tmp_path):
    with pytest.raises(FormatError, match="without dots"):
        save_model(Model(ModelMetadata(), {"a.b": np.ones(2)}), tmp_path / "x.json")
    with pytest.raises(UnsupportedError, match="1-4 dim"):
        save_model(
            Model(ModelMetadata(), {"s": np.float32(1)}),
            tmp_path / "x.gguf",
            SaveConfig(ModelFormat.GGUF),
        )
    with pytest.raises(FormatError, match="dtype"):
        save_model(Model(ModelMetadata(), {"c": np.ones(2, np.complex64)}), "x.json")


def test_failed_write_leaves_old_file(tmp_path):
    path = tmp_path / "m.json"
    save_model(_model(["float32"]), path, SaveConfig(ModelFormat.JSON))
    before = path.read_bytes()
    with pytest.raises(EntrenarError):
        bad = Model(ModelMetadata(), {"w": np.ones(2, np.complex64)})
        save_model(bad, path, SaveConfig(ModelFormat.JSON))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


@pytest.mark.slow
def test_hf_llama_checkpoint_loads_and_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from entrenar.io import load_hf_llama

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config, params = load_hf_llama(tmp_path)
    tokens = np.array([[3, 17, 5, 60, 2, 9]])
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(config.apply(params, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_llama_gguf_through_load_model_and_save_model(tmp_path):
    from entrenar.io import load_llama_gguf, save_llama_gguf
    from entrenar.nn import LlamaConfig

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
    )
    rng = np.random.default_rng(0)
    params = _flat_shapes_to_tree(config.param_shapes(), rng)
    save_llama_gguf(tmp_path / "a.gguf", config, params, tensor_type="F32")
    model = load_model(tmp_path / "a.gguf")
    assert model.metadata.architecture == "llama"
    assert model.metadata.custom["llama_config"]["num_kv_heads"] == 2
    save_model(model, tmp_path / "b.gguf", SaveConfig(ModelFormat.GGUF))
    _, back, _ = load_llama_gguf(tmp_path / "b.gguf")
    fa, fb = _flat(params), _flat(back)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fb[k]), fa[k], err_msg=k)
    save_model(model, tmp_path / "c.safetensors")  # and on to any other format
    _assert_same(load_model(tmp_path / "c.safetensors"), model)


def _flat_shapes_to_tree(shapes, rng):
    return {
        k: _flat_shapes_to_tree(v, rng)
        if isinstance(v, dict)
        else rng.standard_normal(v).astype(np.float32)
        for k, v in shapes.items()
    }


def test_sharded_hf_checkpoint_and_bad_shards(tmp_path):
    import safetensors.numpy

    from entrenar.io import load_hf_llama
    from entrenar.nn import LlamaConfig, to_hf_names

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
    )
    params = _flat_shapes_to_tree(config.param_shapes(), np.random.default_rng(3))
    flat = {k: np.asarray(v) for k, v in to_hf_names(params).items()}
    names = sorted(flat)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in shards.items():
        safetensors.numpy.save_file({k: flat[k] for k in keys}, tmp_path / file)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config()))
    config2, back = load_hf_llama(tmp_path)
    assert config2.num_kv_heads == 2 and config2.tie_word_embeddings
    fa, fb = _flat(params), _flat(back)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fb[k]), fa[k], err_msg=k)
    weight_map[names[0]] = "../evil.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    with pytest.raises(FormatError, match="plain file name"):
        load_hf_llama(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FormatError, match=r"config\.json"):
        load_hf_llama(tmp_path)


def test_library_param_trees_save_or_say_what_to_do(tmp_path):
    import jax

    from entrenar import lora, optim
    from entrenar.errors import FormatError
    from entrenar.io import Model, ModelMetadata, load_model, save_model
    from entrenar.nn import MLP

    mlp = MLP((3, 4, 2))
    params = mlp.init(jax.random.key(0))  # {"layers": [ {weight, bias}, ... ]}
    for ext in ("safetensors", "json", "gguf"):
        path = tmp_path / f"mlp.{ext}"
        save_model(Model(ModelMetadata("mlp", "mlp"), params), path)
        back = load_model(path).params
        assert isinstance(back["layers"], list) and len(back["layers"]) == 2
        x = jax.numpy.ones((1, 3))
        np.testing.assert_array_equal(mlp.apply(back, x), mlp.apply(params, x))
    adapted = lora.apply(
        {"w": {"weight": jax.numpy.ones((4, 4))}},
        lora.LoRAConfig(rank=1, targets="w"),
        key=jax.random.key(0),
    )
    with pytest.raises(FormatError, match=r"lora\.fold.*save_adapter"):
        save_model(Model(ModelMetadata("m", "x"), adapted), tmp_path / "a.safetensors")
    state = optim.adam(1e-3).init(params)
    with pytest.raises(FormatError, match="Trainer's checkpoints"):
        save_model(Model(ModelMetadata("m", "x"), {"s": state}), tmp_path / "s.json")


def test_disk_bytes_of_a_file_and_of_a_folder(tmp_path):
    from entrenar.io.formats import disk_bytes

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * 3)
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 5)
    assert disk_bytes(str(tmp_path / "a.bin")) == 3
    assert disk_bytes(str(tmp_path)) == 8
