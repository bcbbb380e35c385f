"""Task vectors of quantized files: re-quantization noise flagged, corrected, refused.

The issue's case in small: a base on the Q4_1 grid (a 4-bit GGUF), fine-tunes stored
as Q8_0. Their difference from the base is the Q8_0 rounding of every base weight
plus the update; the noise is flagged, a real low-rank update is not.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import io, merge
from entrenar.errors import ConfigError
from entrenar.lora.export import stored
from entrenar.merge import noise

ROWS, COLS, RANK = 64, 128, 2


def on_grid(x, kind):
    return np.asarray(stored(jnp.asarray(x), kind))


def base_q41(seed=0):
    w = np.random.default_rng(seed).normal(size=(ROWS, COLS)).astype(np.float32)
    return on_grid(w * 0.05, "Q4_1")  # (ROWS, COLS), on the Q4_1 grid


def low_rank(seed, scale):
    rng = np.random.default_rng(seed)
    b, a = rng.normal(size=(ROWS, RANK)), rng.normal(size=(RANK, COLS))
    return (scale * b @ a / np.sqrt(RANK)).astype(np.float32)  # (ROWS, COLS)


def test_grid_of_reads_the_grid_from_the_values():
    w = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    for kind in ("Q4_0", "Q4_1", "Q8_0", "F16"):
        assert noise.grid_of(on_grid(w, kind)) == kind
    assert noise.grid_of(w) is None


def test_a_task_vector_of_requantization_noise_is_flagged():
    base = {"w": base_q41()}
    requantized = {"w": on_grid(base["w"], "Q8_0")}  # no update at all
    r = noise.requantization_noise("ft.gguf", base, requantized)
    assert r.flagged and r.noise == pytest.approx(1.0) and r.update == 0.0
    assert r.grids == {"w": "Q8_0"}
    assert "Q8_0" in r.describe()


def test_a_real_low_rank_update_is_not_flagged():
    base = {"w": base_q41()}
    float_ft = {"w": base["w"] + low_rank(2, 0.01)}  # a folded float model
    r = noise.requantization_noise("ft.safetensors", base, float_ft)
    assert not r.flagged and r.noise == 0.0
    q8_ft = {"w": on_grid(base["w"] + low_rank(2, 0.01), "Q8_0")}  # exported Q8_0
    r = noise.requantization_noise("ft.gguf", base, q8_ft)
    assert not r.flagged and r.update > 3, r


def test_a_small_update_under_the_noise_is_flagged():
    base = {"w": base_q41()}
    ft = {"w": on_grid(base["w"] + low_rank(2, 5e-5), "Q8_0")}
    assert noise.requantization_noise("ft.gguf", base, ft).flagged


def save(path, tree):
    io.save_model(io.Model(io.ModelMetadata("m"), tree), path)
    return str(path)


@pytest.fixture
def files(tmp_path):
    """A Q4_1-grid base and two Q8_0 fine-tunes, as the issue's GGUFs.

    The update is in ``attn`` only (LoRA on the attention projections); ``mlp``
    differs from the base by the Q8_0 rounding alone, and outweighs the update.
    """
    mlp = np.concatenate([base_q41(s) for s in range(1, 33)])  # 32x attn's size
    w = {"attn": base_q41(0), "mlp": mlp}
    deltas = [low_rank(3, 1e-3), low_rank(4, 1e-3)]  # about the Q8_0 step
    models = []
    for i, d in enumerate(deltas):
        ft = {"attn": on_grid(w["attn"] + d, "Q8_0"), "mlp": on_grid(w["mlp"], "Q8_0")}
        models.append(save(tmp_path / f"ft{i}.safetensors", ft))
    return save(tmp_path / "base.safetensors", w), models, w, deltas


def test_the_merge_corrects_noisy_task_vectors(files):
    base, models, w, deltas = files
    with pytest.warns(UserWarning, match="corrected"):
        fixed = merge.merge_files(models, "task_arithmetic", base=base)
    kept = merge.merge_files(models, "task_arithmetic", base=base, quantized="keep")
    np.testing.assert_array_equal(fixed.params["mlp"], w["mlp"])  # no noise left
    assert not np.array_equal(kept.params["mlp"], w["mlp"])
    update = sum(deltas)
    err = np.linalg.norm(np.asarray(fixed.params["attn"]) - w["attn"] - update)
    assert err < 0.5 * np.linalg.norm(update)  # the update is kept


def test_refuse_names_the_better_path(files):
    base, models, _, _ = files
    with pytest.raises(ConfigError, match="adapters") as e:
        merge.merge_files(models, "ties", base=base, density=0.5, quantized="refuse")
    assert "folded float models" in str(e.value) and "ft0.safetensors" in str(e.value)
    with pytest.raises(ConfigError, match="quantized"):
        merge.parse_recipe({"merge_method": "linear", "models": [{"model": "a"}],
                            "quantized": "maybe"})  # fmt: skip


def test_the_adapter_beside_a_noisy_file_is_merged_instead(tmp_path):
    import jax

    from entrenar import lora, nn
    from entrenar.lora import LoRAWeight

    cfg = nn.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
        num_heads=2, num_kv_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    base = tmp_path / "base.gguf"  # a 4-bit base, as the main job's
    io.save_llama_gguf(base, cfg, cfg.init(jax.random.key(0)), tensor_type="Q4_1")
    _, w, _ = io.load_llama_gguf(base)
    adapted = lora.apply(
        w, lora.LoRAConfig(rank=2, alpha=4, targets=("q_proj",)), key=jax.random.key(1)
    )
    adapted = jax.tree_util.tree_map(  # a trained adapter: B is no longer 0
        lambda x: x.replace(b=x.b + 0.05) if isinstance(x, LoRAWeight) else x,
        adapted,
        is_leaf=lambda x: isinstance(x, LoRAWeight),
    )
    run = tmp_path / "run"  # a run's folder: model.gguf with adapter/ beside it
    lora.save_adapter(adapted, run / "adapter")
    io.save_llama_gguf(run / "model.gguf", cfg, w, tensor_type="Q8_0")  # all noise
    with pytest.warns(UserWarning, match="adapter beside"):
        got = merge.merge_files([run / "model.gguf"], "task_arithmetic", base=base)
    want = lora.fold(adapted)
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
        got.params,
        want,
    )
