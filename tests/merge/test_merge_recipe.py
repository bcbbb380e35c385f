"""mergekit-shaped recipes run over model files, read back by ``load_model``."""

import json
import os

import jax
import numpy as np
import pytest
import yaml
from merge_helpers import finetuned, make_tree

from entrenar import io, lora, merge, nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.nn import LlamaConfig, to_hf_names
from entrenar.tree import assert_trees_allclose

TOL = {"rtol": 1e-6, "atol": 1e-6}
LLAMA = LlamaConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=64,
)


def _save(tree, path):
    io.save_model(io.Model(io.ModelMetadata("m"), tree), path, _config(path))


def _config(path):
    ext = os.path.splitext(str(path))[1]
    fmt = {".gguf": io.ModelFormat.GGUF}.get(ext, io.ModelFormat.SAFETENSORS)
    return io.SaveConfig(fmt)


def _recipe(folder, doc, name="recipe.yaml"):
    path = folder / name
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def files(tmp_path):
    base = make_tree(0)
    a, b = finetuned(base, 1), finetuned(base, 2)
    _save(base, tmp_path / "base.safetensors")
    _save(a, tmp_path / "a.gguf")
    _save(b, tmp_path / "b.safetensors")
    return tmp_path, base, a, b


@pytest.mark.parametrize("out", ["merged.safetensors", "merged.gguf"])
def test_ties_recipe_on_gguf_and_safetensors_reads_back(files, out):
    folder, base, a, b = files
    recipe = _recipe(
        folder,
        {
            "merge_method": "ties",
            "base_model": "base.safetensors",
            "models": [
                {"model": "base.safetensors"},  # mergekit lists the base too
                {"model": "a.gguf", "parameters": {"weight": 1.0, "density": 0.4}},
                {"model": "b.safetensors", "parameters": {"weight": 0.5}},
            ],
            "parameters": {"density": 0.7, "normalize": True, "int8_mask": True},
            "dtype": "float32",
        },
    )
    merge.run_recipe(recipe, folder / out)
    back = io.load_model(folder / out)
    want = merge.ties(base, [a, b], [0.4, 0.7], [1.0, 0.5])
    assert_trees_allclose(back.params, want, **TOL)
    assert not [p for p in os.listdir(folder) if p.endswith(".part")]


def test_recipe_settings_resolve_like_mergekit(files):
    folder, base, a, b = files
    weight = [{"filter": "embed_tokens", "value": 2.0}]  # else the global 0.5
    model = merge.run_recipe(
        {
            "merge_method": "task_arithmetic",
            "base_model": str(folder / "base.safetensors"),
            "models": [
                {"model": str(folder / "a.gguf"), "parameters": {"weight": weight}},
                {"model": str(folder / "b.safetensors")},
            ],
            "parameters": {"weight": 0.5, "lambda": 0.9},
        }
    )
    everywhere = merge.task_arithmetic(base, [a, b], [0.5, 0.5], lam=0.9)
    embed = merge.task_arithmetic(base, [a, b], [2.0, 0.5], lam=0.9)
    got = model.params
    np.testing.assert_allclose(
        got["model"]["embed_tokens"]["weight"],
        embed["model"]["embed_tokens"]["weight"],
        **TOL,
    )
    np.testing.assert_allclose(
        got["lm_head"]["weight"], everywhere["lm_head"]["weight"], **TOL
    )


def test_dare_recipe_is_reproducible_and_is_dare(files):
    folder, base, a, b = files
    doc = {
        "merge_method": "dare_ties",
        "base_model": "base.safetensors",
        "models": [
            {"model": "a.gguf", "parameters": {"weight": 1.0, "density": 0.7}},
            {"model": "b.safetensors", "parameters": {"weight": 1.0, "density": 0.7}},
        ],
        "random_seed": 5,
    }
    first = merge.run_recipe(_recipe(folder, doc)).params
    assert_trees_allclose(merge.run_recipe(_recipe(folder, doc)).params, first, rtol=0)
    want = merge.dare(
        base, [a, b], 0.3, key=jax.random.key(5), ties=True, normalize=False
    )
    assert_trees_allclose(first, want, **TOL)


def _llama(seed):
    rng = np.random.default_rng(seed)

    def fill(shapes):
        return {
            k: fill(v) if isinstance(v, dict) else rng.normal(size=v).astype(np.float32)
            for k, v in shapes.items()
        }

    return fill(LLAMA.param_shapes())


def test_slerp_recipe_on_llama_ggufs_writes_a_llama_gguf(tmp_path):
    pa, pb = _llama(1), _llama(2)
    io.save_llama_gguf(tmp_path / "a.gguf", LLAMA, pa, tensor_type="F32")
    io.save_llama_gguf(tmp_path / "b.gguf", LLAMA, pb, tensor_type="F32")
    t = [
        {"filter": "self_attn", "value": [0.0, 0.5, 0.3, 0.7, 1.0]},
        {"filter": "mlp", "value": [1.0, 0.5, 0.7, 0.3, 0.0]},
        {"value": 0.5},
    ]
    doc = {
        "merge_method": "slerp",
        "base_model": "a.gguf",
        "models": [{"model": "a.gguf"}, {"model": "b.gguf"}],
        "parameters": {"t": t},
        "dtype": "float32",
    }
    merge.run_recipe(_recipe(tmp_path, doc), tmp_path / "out.gguf")
    back = io.load_model(tmp_path / "out.gguf")
    assert back.metadata.architecture == "llama"
    want = merge.slerp(pa, pb, t)
    assert_trees_allclose(back.params, want, **TOL)


def _hf_folder(folder, params):
    import safetensors.numpy

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA.to_hf_config()))
    flat = {k: np.ascontiguousarray(v) for k, v in to_hf_names(params).items()}
    safetensors.numpy.save_file(flat, str(folder / "model.safetensors"))


def test_slices_recipe_on_hf_folders_interpolates_t_per_layer(tmp_path):
    pa, pb = _llama(3), _llama(4)
    _hf_folder(tmp_path / "a", pa)
    _hf_folder(tmp_path / "b", pb)
    doc = {
        "slices": [
            {
                "sources": [
                    {"model": "a", "layer_range": [0, 3]},
                    {"model": "b", "layer_range": [0, 3]},
                ]
            }
        ],
        "merge_method": "slerp",
        "base_model": "a",
        "parameters": {"t": [0.0, 0.4, 1.0]},
    }
    merge.run_recipe(_recipe(tmp_path, doc), tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_text() == (
        tmp_path / "a" / "config.json"
    ).read_text()
    _, back = io.load_hf_llama(tmp_path / "out")
    # The flat names layers.{i} get the same t as the stacked tree's layer i.
    assert_trees_allclose(back, merge.slerp(pa, pb, [0.0, 0.4, 1.0]), **TOL)
    doc["slices"][0]["sources"][0]["layer_range"] = [0, 2]
    doc["slices"][0]["sources"][1]["layer_range"] = [0, 2]
    with pytest.raises(UnsupportedError, match=r"only a slice over all 3 layers"):
        merge.run_recipe(_recipe(tmp_path, doc))


def test_model_plus_adapter_folds_the_adapter(files):
    folder, base, _, _ = files
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets="up_proj")
    adapted = lora.apply(base, cfg, key=jax.random.key(0))
    w = adapted["model"]["layers"]["up_proj"]["weight"]
    adapted["model"]["layers"]["up_proj"]["weight"] = w.replace(b=w.b + 0.5)
    lora.save_adapter(adapted, folder / "adapter")
    model = merge.run_recipe(
        _recipe(
            folder,
            {
                "merge_method": "linear",
                "models": [
                    {"model": "base.safetensors+adapter", "parameters": {"weight": 1}},
                    {"model": "base.safetensors", "parameters": {"weight": 3}},
                ],
            },
        )
    )
    folded = (getattr(lora, "fold", None) or lora.merge)(adapted)
    assert_trees_allclose(model.params, merge.linear([folded, base], [1, 3]), **TOL)


def test_model_plus_dora_adapter_folds_the_rescaled_weight(files):
    """``+adapter`` of a DoRA file merges m/‖W+sBA‖ ⊙ (W+sBA) (numpy's fold)."""
    folder, base, _, _ = files
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets="up_proj", use_dora=True)
    adapted = lora.apply(base, cfg, key=jax.random.key(0))
    w = adapted["model"]["layers"]["up_proj"]["weight"]
    w = w.replace(b=w.b + 0.5, magnitude=w.magnitude * 1.3)
    adapted["model"]["layers"]["up_proj"]["weight"] = w
    lora.save_adapter(adapted, folder / "adapter")
    model = merge.run_recipe(
        _recipe(
            folder,
            {
                "merge_method": "linear",
                "models": [
                    {"model": "base.safetensors+adapter", "parameters": {"weight": 1}},
                    {"model": "base.safetensors", "parameters": {"weight": 3}},
                ],
            },
        )
    )
    v = np.asarray(w.base, np.float64) + 2.0 * np.asarray(w.b) @ np.asarray(w.a)
    v *= np.asarray(w.magnitude)[..., None] / np.linalg.norm(v, axis=-1)[..., None]
    folded = jax.tree_util.tree_map(lambda x: x, base)
    folded["model"]["layers"]["up_proj"]["weight"] = v.astype(np.float32)
    assert_trees_allclose(model.params, merge.linear([folded, base], [1, 3]), **TOL)


def test_merge_files_is_a_recipe_without_the_yaml(files, monkeypatch):
    folder, base, a, b = files
    monkeypatch.chdir(folder)
    model = merge.merge_files(
        ["a.gguf", "b.safetensors"],
        "ties",
        folder / "out.safetensors",
        base="base.safetensors",
        weights=[1.0, 2.0],
        density=0.5,
    )
    want = merge.ties(base, [a, b], 0.5, [1.0, 2.0])
    assert_trees_allclose(io.load_model(folder / "out.safetensors").params, want, **TOL)
    assert_trees_allclose(model.params, want, **TOL)


@pytest.mark.parametrize(
    ("doc", "error", "match"),
    [
        ({"merge_method": "ties", "models": [], "extra": 1}, ConfigError, "'extra'"),
        (
            {"merge_method": "breadcrumbs", "models": [{"model": "a"}]},
            ConfigError,
            "breadcrumbs",
        ),
        (
            {"merge_method": "ties", "models": [{"model": "a"}]},
            ConfigError,
            "needs a base_model",
        ),
        (
            {
                "merge_method": "linear",
                "models": [{"model": "a", "parameters": {"density": 0.5}}],
            },
            ConfigError,
            r"\['density'\] not used by linear",
        ),
        (
            {"merge_method": "linear", "models": [{"model": "a"}], "dtype": "int8"},
            ConfigError,
            "dtype 'int8'",
        ),
        (
            {
                "merge_method": "slerp",
                "base_model": "a",
                "models": [{"model": "b"}],
                "parameters": {"t": "x"},
            },
            ConfigError,
            "parameters.t",
        ),
        (
            {
                "merge_method": "ties",
                "base_model": "a",
                "models": [{"model": "b"}],
                "parameters": {"normalize": 1},
            },
            ConfigError,
            "true or false",
        ),
        (
            {
                "merge_method": "linear",
                "models": [{"model": "a"}],
                "tokenizer_source": "union",
            },
            UnsupportedError,
            "tokenizer_source",
        ),
        (
            {"merge_method": "linear", "slices": [{"sources": [{"model": "a"}]}] * 2},
            UnsupportedError,
            "one slice",
        ),
    ],
)
def test_bad_recipes_name_the_key(doc, error, match):
    with pytest.raises(error, match=match):
        merge.parse_recipe(doc)


def test_recipe_files_and_models_must_exist(tmp_path):
    with pytest.raises(FormatError, match="no such recipe"):
        merge.load_recipe(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("merge_method: [unclosed")
    with pytest.raises(FormatError, match="not valid YAML"):
        merge.load_recipe(tmp_path / "bad.yaml")
    doc = {"merge_method": "linear", "models": [{"model": "nope.safetensors"}]}
    with pytest.raises(FormatError, match=r"nope\.safetensors: no such model"):
        merge.run_recipe(_recipe(tmp_path, doc))


def test_merge_files_checks_its_arguments():
    with pytest.raises(ConfigError, match="1 weights for 2 models"):
        merge.merge_files(["a", "b"], "linear", weights=[1.0])
    with pytest.raises(ConfigError, match="3 densities for 2 models"):
        merge.merge_files(["a", "b"], "ties", base="c", density=[0.5] * 3)
    with pytest.raises(ConfigError, match="density or drop_rate"):
        merge.merge_files(["a"], "dare_ties", base="c", density=0.5, drop_rate=0.5)


def test_recipe_over_mlp_files_equals_in_memory_ties(tmp_path):
    """An MLP's ``layers.[i].weight`` is one layer's tensor, not a stack of rows.

    (Read as stacked, TIES trimmed each row to its own density: up to 0.37 off.)
    """
    model = nn.MLP([6, 16, 3])
    trees = [model.init(jax.random.key(i)) for i in range(3)]
    files = []
    for i, tree in enumerate(trees):
        files.append(str(tmp_path / f"m{i}.safetensors"))
        io.save_model(tree, files[-1])  # a bare params tree
    doc = {
        "merge_method": "ties",
        "base_model": files[0],
        "models": [{"model": f, "parameters": {"weight": 1.0}} for f in files[1:]],
        "parameters": {"density": 0.5},
    }
    merge.run_recipe(doc, tmp_path / "out.safetensors")
    got = io.load_model(tmp_path / "out.safetensors").params
    assert_trees_allclose(got, merge.ties(trees[0], trees[1:], density=0.5), **TOL)
