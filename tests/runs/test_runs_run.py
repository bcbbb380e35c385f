"""train_from_yaml end to end on small real data: files, resume, overrides, exports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from config_cases import CONFIGS, WINE, WORDS, wine_yaml_factory, write

from entrenar import io, lora, nn, quant
from entrenar.errors import ConfigError
from entrenar.runs import load_built, train_from_yaml
from entrenar.runs.evaluate import evaluate_model
from entrenar.tree import assert_trees_allclose


@pytest.fixture
def wine_yaml(tmp_path):
    """``wine_yaml(**sections) -> path`` of a tiny wine run (config_cases)."""
    return wine_yaml_factory(tmp_path)


def _run(path, **overrides):
    return train_from_yaml(path, overrides or None, progress=False)


def test_wine_run_writes_metrics_checkpoints_and_a_model(wine_yaml):
    result = _run(wine_yaml())
    out = Path(result.output_dir)
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert sorted(os.listdir(out / "checkpoints")) == ["3", "6"]
    assert result.metrics["steps"] == 6
    built = load_built(str(out / "model.safetensors"))
    assert built.architecture == "mlp" and built.config.sizes == (13, 8, 3)
    assert_trees_allclose(built.params, result.train.params, rtol=0, atol=0)
    metrics = evaluate_model(
        str(out / "model.safetensors"), str(WINE / "validation.parquet")
    )
    assert metrics["examples"] == 36
    assert metrics["eval_loss"] == pytest.approx(_numpy_loss(built), rel=1e-5)


def _numpy_loss(built):
    """Mean cross-entropy on the validation file, in numpy from the stored stats."""
    import pyarrow.parquet as pq

    table = pq.read_table(WINE / "validation.parquet").to_pydict()
    tab = built.custom["tabular"]
    x = np.stack([np.asarray(table[c], np.float64) for c in tab["features"]], 1)
    x = (x - np.asarray(tab["mean"])) / np.asarray(tab["std"])
    h = x
    layers = built.params["layers"]
    for i, layer in enumerate(layers):
        h = h @ np.asarray(layer["weight"], np.float64).T + np.asarray(layer["bias"])
        if i < len(layers) - 1:
            h = np.maximum(h, 0)
    y = np.asarray(table["cultivar"])
    logp = (
        h
        - np.log(np.exp(h - h.max(1, keepdims=True)).sum(1, keepdims=True))
        - (h.max(1, keepdims=True))
    )
    return float(-logp[np.arange(len(y)), y].mean())


def test_resume_continues_to_the_same_end(wine_yaml, tmp_path):
    full = _run(wine_yaml(), **{"training.output_dir": str(tmp_path / "full")})
    part = tmp_path / "part"
    _run(wine_yaml(), **{"training.output_dir": str(part), "training.max_steps": 3})
    resumed = train_from_yaml(
        wine_yaml(),
        {"training.output_dir": str(part)},
        resume="latest",
        progress=False,
    )
    assert resumed.metrics["steps"] == 6
    assert_trees_allclose(resumed.train.params, full.train.params, rtol=0, atol=0)


def test_resume_removes_the_files_a_killed_export_left(wine_yaml, tmp_path):
    """A run killed mid-export leaves ``.tmp-*.part``; its resume removes them.

    `atomic_write` renames a complete temporary file into place; SIGKILL before the
    rename left the temporary (a GGUF's is the model's size) in the output folder
    and in ``adapter/`` or ``hf/`` forever, beside the finished files. Found by
    tests/runs/test_cli_kill_resume.py.
    """
    out = tmp_path / "out"
    _run(wine_yaml(), **{"training.output_dir": str(out)})
    (out / "adapter").mkdir()
    killed = (  # killed by SIGKILL in the middle of an atomic write
        "import os, signal, sys\n"
        "from entrenar.io import atomic_write\n"
        "writing = atomic_write(sys.argv[1])\n"
        "f = writing.__enter__()\n"
        "f.write(b'half'); f.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        subprocess.run([sys.executable, "-c", killed, str(out / name)], check=False)
    left = sorted(p.name for p in out.rglob(".tmp-*.part"))
    assert len(left) == 2, left
    (out / ".tmp-mine.txt").write_text("not entrenar's")  # not a temporary: kept
    train_from_yaml(wine_yaml(), {"training.output_dir": str(out)}, resume="latest",
                    progress=False)  # fmt: skip
    assert not list(out.rglob(".tmp-*.part"))
    assert (out / ".tmp-mine.txt").exists()


def test_resume_refuses_a_config_that_trains_another_model_or_data(wine_yaml, tmp_path):
    """--resume with a changed model, adapters, teacher or examples is refused.

    The checkpoint's arrays restore silently whenever the shapes agree: a LoRA run
    resumed on another base GGUF, another lora.alpha, another data file or
    normalisation went on training (found with `entrenar train --resume latest` on
    tests/runs/test_cli_kill_resume.py's runs). A longer run is free; another
    learning rate goes on with a warning (the Trainer's rule for the data order).
    """
    out = str(tmp_path / "out")
    _run(wine_yaml(), **{"training.output_dir": out, "training.max_steps": 3})

    def resume(**changes):
        return train_from_yaml(wine_yaml(), {"training.output_dir": out, **changes},
                               resume="latest", progress=False)  # fmt: skip

    for key, value in (
        ("data.normalize", False),
        ("data.train", str(WINE / "validation.parquet")),
    ):
        with pytest.raises(
            ConfigError,
            match=rf"--resume latest: .*{key}: .* then, .* now.*Put the values back",
        ):
            resume(**{key: value})
    with pytest.warns(UserWarning, match=r"optimizer\.lr: 0\.01 then, 0\.02 now"):
        assert (
            resume(**{"optimizer.lr": 0.02, "training.max_steps": 4}).metrics["steps"]
            == 4
        )
    # the config.json of the resumed run is the new one: a longer run says nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            resume(**{"optimizer.lr": 0.02, "training.max_steps": 5}).metrics["steps"]
            == 5
        )


@pytest.mark.parametrize(
    ("scheduler", "moved"),
    [
        ({"name": "linear", "warmup_steps": 1}, True),  # decays over the run
        ({"name": "linear", "warmup_steps": 1, "decay_steps": 6}, False),
        ({"name": "constant", "warmup_steps": 2}, False),
    ],
)
def test_extending_a_run_at_resume_warns_when_its_schedule_moves(
    wine_yaml, tmp_path, scheduler, moved
):
    """A longer run at resume re-lays a length-dependent schedule: it warns.

    specs/trainer.md said a run extended at resume ends as an uninterrupted one; a
    linear decay over 3 steps extended to 5 trains steps 1-3 at the 3-step rates
    and 4-5 at the 5-step ones, matching neither run (the rates below, by hand:
    step n logs lr(n - 1); warm-up to 0.01 at step 2, then linear to 0 at the run's
    end).
    """
    out = str(tmp_path / "out")
    path = wine_yaml(scheduler=scheduler)
    _run(path, **{"training.output_dir": out, "training.max_steps": 3})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_from_yaml(path, {"training.output_dir": out, "training.max_steps": 5},
                        resume="latest", progress=False)  # fmt: skip
    said = [
        str(w.message) for w in caught if "laid over the new length" in str(w.message)
    ]
    assert bool(said) == moved, said
    if moved:
        assert "5 steps, 3 before" in said[0] and "first at step 3" in said[0]
        rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").open()]
        lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
        # 3 steps: 0, 0.01, 0.005; steps 4 and 5 at the 5-step lr(3) = 0.01·2/4
        # and lr(4) = 0.01·1/4 (an uninterrupted 5-step run trains step 3 at
        # 0.01·3/4). Step 4 logged the checkpoint's stored rate, the 3-step lr(3)
        # = 0, not the rate it trained at.
        want = [0.0, 0.01, 0.005, 0.005, 0.0025]
        np.testing.assert_allclose([lr[n] for n in range(1, 6)], want, rtol=1e-6)


def test_overrides_change_the_run(wine_yaml, tmp_path):
    base = _run(wine_yaml(), **{"training.output_dir": str(tmp_path / "a")})
    lr = _run(
        wine_yaml(), **{"training.output_dir": str(tmp_path / "b"), "optimizer.lr": 0.1}
    )
    seed = _run(
        wine_yaml(), **{"training.output_dir": str(tmp_path / "c"), "training.seed": 3}
    )
    w = [r.train.params["layers"][0]["weight"] for r in (base, lr, seed)]
    assert not np.allclose(w[0], w[1]) and not np.allclose(w[0], w[2])
    plan = train_from_yaml(wine_yaml(), {"data.batch_size": 4}, dry_run=True)
    assert plan.metrics["steps_per_epoch"] == 142 // 4


def test_dry_run_writes_nothing(wine_yaml, tmp_path):
    result = train_from_yaml(wine_yaml(), dry_run=True, progress=False)
    assert result.metrics["steps"] == 6 and result.metrics["parameters"] == 139
    assert not (tmp_path / "run").exists()


def test_lora_on_an_mlp_trains_only_the_adapters(wine_yaml):
    path = wine_yaml(
        lora={"rank": 2, "alpha": 4, "targets": "all-linear"},
        export={"formats": ["adapter", "safetensors"]},
    )
    result = _run(path)
    params = result.train.params
    w = params["layers"][0]["weight"]
    assert isinstance(w, lora.LoRAWeight)
    built = load_built(result.files["safetensors"])
    assert_trees_allclose(built.params, lora.fold(params), rtol=1e-6, atol=1e-6)
    adapter = lora.load_adapter(result.files["adapter"], _base(params))
    assert_trees_allclose(lora.fold(adapter), built.params, rtol=1e-5, atol=1e-6)


def _base(params):
    return jax.tree_util.tree_map(
        lambda x: x.base if isinstance(x, lora.LoRAWeight) else x,
        params,
        is_leaf=lambda x: isinstance(x, lora.LoRAWeight),
    )


def test_distillation_run_writes_the_student(tmp_path):
    doc = (CONFIGS / "wine-distill.yaml").read_text()
    path = tmp_path / "d.yaml"
    path.write_text(doc.replace("../", str(CONFIGS.parent) + "/"))
    result = _run(
        path,
        **{
            "training.output_dir": str(tmp_path / "out"),
            "training.epochs": None,
            "training.max_steps": 4,
        },
    )
    assert {"kl", "ce"} <= set(result.train.history[-1])
    student = load_built(result.files["safetensors"])
    assert student.config.sizes == (13, 8, 3)


def test_merge_config_writes_a_model_that_loads(tmp_path):
    result = _run(
        CONFIGS / "wine-merge.yaml", **{"training.output_dir": str(tmp_path / "m")}
    )
    merged = load_built(result.files["merged"])
    assert merged.architecture == "mlp"
    out = evaluate_model(result.files["merged"], str(WINE / "validation.parquet"))
    assert out["accuracy"] > 0.8


def test_a_merge_of_folders_is_written_as_a_folder(tmp_path):
    """``export.formats: [hf]`` writes ``hf/``; a model-file format is refused.

    Before, a config merge of Hugging Face folders wrote ``model.safetensors`` with
    the folders' tensor names and no architecture (unreadable by entrenar eval).
    """
    config = nn.architecture("llama").tiny()
    trees = [config.init(jax.random.key(i)) for i in range(2)]
    for i, tree in enumerate(trees):
        io.save_hf_folder(tmp_path / f"hf{i}", config, tree)
    doc = {
        "merge": {"merge_method": "linear", "dtype": "float32",
                  "models": [{"model": f"hf{i}", "parameters": {"weight": 0.5}}
                             for i in range(2)]},
        "training": {"output_dir": str(tmp_path / "out")},
    }  # fmt: skip
    path = tmp_path / "merge.yaml"
    refused = [
        (None, r"set export.formats to \[hf\]"),
        (["hf", "gguf"], r"\(got \['hf', 'gguf'\]\)"),
    ]
    for formats, message in refused:
        write(path, doc if formats is None else {**doc, "export": {"formats": formats}})
        with pytest.raises(ConfigError, match=message):
            train_from_yaml(path)
    write(path, {**doc, "export": {"formats": ["hf"]}})
    result = train_from_yaml(path)
    assert result.files == {"merged": str(tmp_path / "out" / "hf")}
    _, merged = io.load_hf_folder(result.files["merged"])
    want = jax.tree.map(lambda a, b: (a + b) / 2, *trees)
    assert_trees_allclose(merged, want, atol=1e-6)


def test_a_quantization_that_quantizes_nothing_is_refused_before_training(
    wine_yaml, tmp_path
):
    """int8 in blocks of 64 on the wine MLP (rows of 13 and 8): refused up front.

    The quantized copy is written after training, which then failed ("no weight of
    this model has rows that split into blocks of 64; choose a smaller
    --block-size", a flag of `entrenar quantize`, not a key of the run) with the
    whole run trained; found while killing runs in test_cli_kill_resume.py.
    """
    out = tmp_path / "out"
    for dry_run in (True, False):
        with pytest.raises(
            ConfigError,
            match=r"int8 in blocks of 64 .*quantization\.block_size.*per_channel",
        ):
            train_from_yaml(
                wine_yaml(quantization={"scheme": "int8"}),
                {"training.output_dir": str(out)}, dry_run=dry_run, progress=False,
            )  # fmt: skip
    assert not (out / "metrics.jsonl").exists()  # nothing trained
    ok = wine_yaml(quantization={"scheme": "int8", "per_channel": True})
    assert train_from_yaml(ok, dry_run=True).metrics["steps"] == 6


def test_quantized_copy_reads_back_as_quantized_weights(wine_yaml):
    path = wine_yaml(quantization={"scheme": "int8", "block_size": 4})
    result = _run(path)
    q = load_built(result.files["quantized"])
    first, second = (layer["weight"] for layer in q.params["layers"])
    assert not quant.is_quantized(first)  # rows of 13 do not split into blocks of 4
    assert quant.is_quantized(second) and second.scheme == "int8"
    assert second.shape == (3, 8) and second.block_size == 4
    x = jnp.ones((2, 13))
    dense = load_built(result.files["safetensors"])
    np.testing.assert_allclose(
        q.config.apply(q.params, x), dense.config.apply(dense.params, x), atol=0.05
    )


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama GGUF (no tokenizer inside) of the number-words vocabulary."""
    folder = tmp_path_factory.mktemp("llama")
    cfg = nn.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
    )
    io.save_llama_gguf(folder / "tiny.gguf", cfg, cfg.init(jax.random.key(0)))
    lines = (WORDS / "train.jsonl").read_text().splitlines()[:64]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.mark.slow
def test_qlora_run_exports_adapter_gguf_hf_and_quantized(tiny_llama):
    doc = {
        "model": {"path": "tiny.gguf", "tokenizer": str(WORDS / "tokenizer.gguf")},
        "data": {
            "train": "train.jsonl",
            "validation": "train.jsonl",
            "format": "prompt_completion",
            "batch_size": 8,
            "seq_len": 24,
        },
        "lora": {
            "rank": 4,
            "alpha": 8,
            "targets": ["q_proj", "v_proj"],
            "quantize_base": "nf4",
        },
        "optimizer": {"name": "adamw", "lr": 0.01},
        "training": {"max_steps": 3, "output_dir": str(tiny_llama / "out")},
        "quantization": {"scheme": "q8_0"},
        "export": {
            "formats": ["adapter", "safetensors", "gguf", "hf"],
            "gguf_type": "F32",
        },
    }
    result = _run(write(tiny_llama / "run.yaml", doc))
    files = result.files
    assert {"adapter", "safetensors", "gguf", "hf", "quantized"} <= set(files)
    assert files["quantized"].endswith("model-q8_0.gguf")
    trained = result.train.params
    folded = lora.fold(trained)
    config, from_gguf, _ = io.load_llama_gguf(files["gguf"])
    hf_config, from_hf = io.load_hf_llama(files["hf"])
    assert hf_config.vocab_size == 320
    dense = quant.dequantize_params(folded)
    assert_trees_allclose(from_gguf, dense, rtol=1e-6, atol=1e-6)
    assert_trees_allclose(from_hf, dense, rtol=1e-6, atol=1e-6)
    ids = jnp.asarray([[5, 9, 30, 2]], jnp.int32)
    with_adapter = lora.load_adapter(files["adapter"], _dense_base(trained))
    np.testing.assert_allclose(
        config.apply(with_adapter, ids), config.apply(from_gguf, ids), atol=1e-4
    )
    _, q8, _ = io.load_llama_gguf(files["quantized"])
    np.testing.assert_allclose(
        config.apply(q8, ids), config.apply(dense, ids), atol=0.05
    )
    # specs/config.md's "What a run writes" names every file written, and hf/'s
    unlisted = [n for n in os.listdir(tiny_llama / "out") if not _documented(n)]
    assert not unlisted, f"not in specs/config.md's table of a run's files: {unlisted}"
    hf_row = next(r for r in _written_rows() if r.startswith("| `hf/`"))
    assert all(f"`{n}`" in hf_row for n in os.listdir(files["hf"])), hf_row


def _written_rows() -> list[str]:
    """The rows of specs/config.md's table "What a run writes"."""
    text = (Path(__file__).parents[2] / "specs" / "config.md").read_text()
    table = text[text.index("## What a run writes") :].split("\n\n")[1]
    return table.splitlines()[2:]


def _documented(name: str) -> bool:
    """Whether a file of a run's folder is named by a row (`<step>`: any text)."""
    for row in _written_rows():
        for entry in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            pattern = re.sub(r"<\w+>", ".+", re.escape(entry.split("/")[0]))
            if re.fullmatch(pattern, name):
                return True
    return False


def _dense_base(params):
    return quant.dequantize_params(_base(params))


@pytest.mark.slow
def test_shipped_wine_config_learns_the_held_out_cultivars(tmp_path):
    result = _run(CONFIGS / "wine-mlp.yaml", **{"training.output_dir": str(tmp_path)})
    out = evaluate_model(result.files["safetensors"], str(WINE / "validation.parquet"))
    assert out["accuracy"] >= 0.9, out


@pytest.mark.slow
def test_shipped_lora_config_teaches_the_gpt2_ordinals(tmp_path):
    val = str(WORDS / "ordinals_validation.jsonl")
    base = evaluate_model(
        str(CONFIGS.parent / "models" / "number-words-gpt2.safetensors"),
        val,
        fmt="prompt_completion",
    )
    result = _run(
        CONFIGS / "number-words-gpt2-lora.yaml",
        **{"training.output_dir": str(tmp_path), "training.max_steps": 60},
    )
    tuned = evaluate_model(result.files["safetensors"], val, fmt="prompt_completion")
    assert tuned["eval_loss"] < 0.5 * base["eval_loss"], (base, tuned)


def test_lora_errors_name_the_targets_key_and_keep_their_type(wine_yaml):
    """`lora.apply`'s ConfigError is caught by its class and prefixed with the key."""
    path = wine_yaml(lora={"rank": 2, "alpha": 4, "targets": ["no_such_layer"]})
    with pytest.raises(ConfigError, match=r"^lora\.targets: "):
        train_from_yaml(path, dry_run=True, progress=False)


def test_run_with_ranks_by_layer_exports_each_layer_at_its_rank(tiny_llama):
    """lora.rank_pattern / alpha_pattern by layer in a YAML run.

    The adapter is written with each layer at its own rank and the run's patterns
    (as PEFT writes its config's); it loads back onto the base with the forward of
    the folded GGUF the run exports. Before: 'unknown key lora.rank_pattern'.
    """
    patterns = {
        "rank_pattern": {
            "model.layers.0.self_attn.q_proj": 6,
            r"layers\.1\.mlp\..*": 2,
        },
        "alpha_pattern": {"v_proj": 3},
    }
    doc = {
        "model": {"path": "tiny.gguf", "tokenizer": str(WORDS / "tokenizer.gguf")},
        "data": {"train": "train.jsonl", "format": "prompt_completion",
                 "batch_size": 8, "seq_len": 24},
        "lora": {"rank": 4, "alpha": 8, "targets": "all-linear", **patterns},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "training": {"max_steps": 2, "output_dir": str(tiny_llama / "ranks")},
        "export": {"formats": ["adapter", "gguf"], "gguf_type": "F32"},
    }  # fmt: skip
    files = _run(write(tiny_llama / "ranks.yaml", doc)).files
    written = json.loads(Path(files["adapter"], "adapter_config.json").read_text())
    assert {k: written[k] for k in patterns} == patterns
    st = pytest.importorskip("safetensors.numpy")
    tensors = st.load_file(os.path.join(files["adapter"], "adapter_model.safetensors"))
    name = "base_model.model.model.layers.{}.{}.lora_A.weight"
    assert tensors[name.format(0, "self_attn.q_proj")].shape[0] == 6
    assert tensors[name.format(1, "self_attn.q_proj")].shape[0] == 4
    assert tensors[name.format(1, "mlp.up_proj")].shape[0] == 2
    config, from_gguf, _ = io.load_llama_gguf(files["gguf"])
    base = load_built(str(tiny_llama / "tiny.gguf")).params
    ids = jnp.asarray([[5, 9, 30, 2]], jnp.int32)
    np.testing.assert_allclose(
        config.apply(lora.load_adapter(files["adapter"], base), ids),
        config.apply(from_gguf, ids),
        atol=1e-4,
    )


def test_every_lora_setting_but_dropout_is_refused_on_resume():
    """A new LoRA option must say whether a resumed run may change it.

    Before: ``lora.use_dora``, ``lora.rank_pattern`` and ``lora.alpha_pattern``
    (added beside the resume check) were only warned about.
    """
    import dataclasses

    from entrenar.lora import LoRAConfig
    from entrenar.runs.run import RESUME_REFUSED

    keys = {f"lora.{f.name}" for f in dataclasses.fields(LoRAConfig)}
    assert keys - {"lora.dropout"} <= set(RESUME_REFUSED)
