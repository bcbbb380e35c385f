"""`plan_memory` (``training.max_memory``, ``entrenar info --memory``).

The parts are checked against the run's real objects (`prepare`, the Trainer's
state and its compiled step, built from the weights) and against byte counts
written out by hand; the whole prediction against the peak resident memory of the
same run in a fresh process; a run over its budget is refused before loading.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from config_cases import WORDS, write

from entrenar import io, lora, nn, quant
from entrenar.cli import cli
from entrenar.config import validate
from entrenar.errors import ConfigError
from entrenar.runs import run as run_mod
from entrenar.runs.build import train_config
from entrenar.runs.memory_plan import (
    COMPILER_BYTES,
    RUNTIME_BYTES,
    TOKEN_BYTES,
    format_plan,
    plan_memory,
)
from entrenar.train import Trainer
from entrenar.train.config import parse_bytes
from entrenar.tree import tree_bytes

CFG = dict(
    vocab_size=320, hidden_size=128, intermediate_size=384, num_layers=2,
    num_heads=4, num_kv_heads=2, max_position_embeddings=64,
)  # fmt: skip
ROWS = [json.loads(x) for x in (WORDS / "train.jsonl").read_text().splitlines()[:64]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer float32 Llama GGUF of the number-words vocabulary."""
    cfg = nn.LlamaConfig(**CFG)
    path = tmp_path_factory.mktemp("model") / "model.gguf"
    io.save_llama_gguf(path, cfg, cfg.init(jax.random.key(0)))
    return path


def _doc(tmp_path, path, **sections):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    doc = {
        "model": {"path": str(path), "tokenizer": str(WORDS / "tokenizer.gguf")},
        "data": {"train": str(train), "format": "prompt_completion",
                 "batch_size": 4, "seq_len": 16},
        "lora": {"rank": 4, "targets": ["q_proj", "v_proj"], "quantize_base": "nf4"},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "training": {"max_steps": 2, "output_dir": str(tmp_path / "out"),
                     "log_every": 1},
        "export": {"formats": ["adapter"]},
    }  # fmt: skip
    for key, value in sections.items():
        doc[key] = doc.get(key, {}) | value
    return write(tmp_path / "run.yaml", doc)


def test_sizes_parse():
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("7.5 GiB") == int(7.5 * 2**30)
    assert parse_bytes("512mb") == 512 * 10**6 and parse_bytes(1234) == 1234
    for bad in ("eight GB", "-1GB", "0", True, "8 GBs"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)


def test_parts_are_the_run_s_own_bytes(tmp_path, tiny_gguf):
    """Each part equals the bytes of the object the run builds from the weights."""
    spec = validate(_doc(tmp_path, tiny_gguf, model={"matmul_dtype": "bfloat16"}))
    plan = plan_memory(spec)
    prep = run_mod.prepare(spec)  # the weights, loaded and quantized
    adapters, frozen = lora.split(prep.params)
    old = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(adapters)]
    adapter_bytes = tree_bytes(adapters)  # the Trainer takes (deletes) these arrays
    trainer = Trainer(
        prep.loss, prep.params, prep.optimizer, train_config(spec, progress=False),
        trainable=prep.trainable, donate_params=True,  # as the run's
    )  # fmt: skip
    state = trainer.state
    assert plan.weights == tree_bytes(frozen)
    assert plan.adapters == adapter_bytes
    new = jax.tree_util.tree_leaves(state.trainable)  # the run's memory, no copy
    assert plan.state_copy == 0
    assert [x.unsafe_buffer_pointer() for x in new] == old
    assert plan.optimizer == tree_bytes(state.opt_state)
    # bfloat16 matmuls: the frozen half the step reads adds a bfloat16 copy of
    # the float projections (k, o, gate, up, down: not the NF4 q and v)
    r, d, kv, f, layers = 4, 128, 2 * 32, 384, 2
    # (and the untied lm_head, 320 x 128); the state holds them in place of their
    # float32 values, which the run's tree keeps: 4 - 2 bytes = 2 bytes each less
    assert plan.bf16_copy == tree_bytes(frozen) - tree_bytes(state.frozen)
    assert plan.bf16_copy == 2 * (layers * (d * kv + d * d + 3 * d * f) + 320 * d)
    # by hand: rank 4 on q (128 -> 128) and v (128 -> 64), 2 layers, float32
    assert plan.adapters == 4 * layers * r * ((d + d) + (d + kv))
    # AdamW keeps m and v like the adapters, and a few scalars
    assert 2 * plan.adapters <= plan.optimizer < 2 * plan.adapters + 64

    # NF4 bases of q and v: 4 bits per weight; one 8-bit scale per 64 weights
    # (double quantization); per layer a float32 scale per 256 blocks and a
    # float32 mean; everything else float32 as loaded
    def nf4_bytes(n: int) -> int:  # n weights per layer
        return layers * (n // 2 + n // 64 + 4 * -(-(n // 64) // 256) + 4)

    nf4 = nf4_bytes(d * d) + nf4_bytes(d * kv)
    is_q = lambda x: isinstance(x, quant.QuantizedWeight)  # noqa: E731
    leaves = jax.tree_util.tree_leaves(frozen, is_leaf=is_q)
    assert sum(map(is_q, leaves)) == 2  # q and v
    floats = sum(4 * int(x.size) for x in leaves if not is_q(x))
    assert plan.weights == nf4 + floats
    # the step: XLA's assignment of the Trainer's own step on the real batch
    batch = next(iter(prep.data.train))
    compiled = trainer._step_fn.jitted.lower(
        state.trainable, state.opt_state, state.frozen, state.step, state.key, batch
    ).compile()
    m = compiled.memory_analysis()
    step = m.temp_size_in_bytes + tree_bytes(batch)
    step += m.output_size_in_bytes - m.alias_size_in_bytes
    assert plan.step == step
    assert plan.runtime == RUNTIME_BYTES + TOKEN_BYTES * 320  # a 320-token tokenizer
    assert plan.train_peak == (
        plan.runtime + COMPILER_BYTES + plan.weights + plan.adapters
        + plan.bf16_copy + plan.state_copy + plan.optimizer + plan.step
    )  # fmt: skip


def test_adamw_8bit_plans_two_bytes_a_parameter(tmp_path, tiny_gguf):
    """Full fine-tuning with adamw_8bit plans its state's bytes.

    uint8 m and v plus a float32 absmax per 256 values each for every leaf of 4096
    values or more, float32 m and v below.
    """
    doc = yaml.safe_load(_doc(tmp_path, tiny_gguf).read_text())
    del doc["lora"]
    doc["optimizer"] = {"name": "adamw_8bit", "lr": 0.01}
    doc["export"] = {"formats": ["safetensors"]}
    doc["training"] |= {"grad_accum": 2, "grad_clip": 1.0}
    path = write(tmp_path / "full.yaml", doc)
    spec = validate(path)
    plan = plan_memory(spec, compile_step=False)
    params = nn.LlamaConfig(**CFG).init(jax.random.key(0))
    sizes = [int(x.size) for x in jax.tree_util.tree_leaves(params)]
    by_hand = sum(2 * n + 8 * -(-n // 256) if n >= 4096 else 8 * n for n in sizes)
    assert plan.optimizer - by_hand in range(0, 64)  # + the count and rate scalars
    n = sum(sizes)
    assert plan.optimizer < 0.27 * 8 * n  # float32 AdamW: 8 bytes a parameter
    # the run itself (micro-batches and clipping around the optimizer) holds them
    r = run_mod.train_from_yaml(path, progress=False)
    opt_state = r.train.state.opt_state
    assert tree_bytes(opt_state) == plan.optimizer
    leaves = jax.tree_util.tree_leaves(opt_state)
    assert sum(x.dtype == jax.numpy.uint8 for x in leaves) == 2 * sum(
        n >= 4096 for n in sizes
    )
    assert r.metrics["steps"] == 2 and np.isfinite(r.metrics["train_loss"])


@pytest.mark.parametrize("kind", ["BF16", "Q8_0"])
def test_kept_gguf_bases_are_counted_as_stored(tmp_path, kind):
    """``keep_quantized``: the weights are the bytes of the nodes the load keeps.

    `GGMLWeight` bytes for BF16, `QuantizedWeight` codes and scales for Q8_0.
    """
    cfg = nn.LlamaConfig(**CFG)
    path = tmp_path / f"model-{kind}.gguf"
    io.save_llama_gguf(path, cfg, cfg.init(jax.random.key(0)), tensor_type=kind)
    doc = _doc(tmp_path, path, model={"keep_quantized": True})
    spec = validate(doc)
    plan = plan_memory(spec, compile_step=False)
    adapters, frozen = lora.split(run_mod.prepare(spec).params)
    assert plan.weights == tree_bytes(frozen) and plan.adapters == tree_bytes(adapters)
    assert plan.step == 0 and kind in plan.weights_detail


PEAK = """
import json, sys
from entrenar.config import validate
from entrenar.runs import run
spec = validate(sys.argv[1])
res = run._train(spec, run.prepare(spec), resume=None, progress=False)
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(json.dumps({"peak": int(line.split()[1]) * 1024}))
"""

TOLERANCE = 0.20
"""A tiny run's peak is mostly the fixed parts (`RUNTIME_BYTES`, `COMPILER_BYTES`:
0.53 GB; this run peaked at 0.59 GB on one machine and 0.62 GB on another): within
20% here means those constants hold for a small program as well (a compiler that
kept 0.3 GB less, or a step that allocated its arguments again, fails); the 15% of
issue 31 is checked on the large shapes of benchmarks/memory_plan.py, where the
weights and the step dominate."""


def test_a_tiny_run_peaks_where_predicted(tmp_path, tiny_gguf):
    doc = _doc(
        tmp_path, tiny_gguf, lora={"targets": "all-linear"},
        data={"batch_size": 8, "seq_len": 64},
    )  # fmt: skip
    plan = plan_memory(validate(doc))
    # Measured as a user's run: it compiles (entrenar sets no persistent cache; a step
    # read from the suite's cache skips the compiler's memory) and is not traced by
    # pytest-cov (its COV_CORE_* variables make a subprocess record coverage).
    env = {k: v for k, v in os.environ.items() if not k.startswith("COV_CORE_")}
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR="")
    res = subprocess.run(
        [sys.executable, "-c", PEAK, str(doc)], capture_output=True, text=True,
        env=env, cwd=tmp_path, check=True,
    )  # fmt: skip
    peak = json.loads(res.stdout.strip().splitlines()[-1])["peak"]
    assert abs(plan.peak - peak) <= TOLERANCE * peak, (
        f"predicted {plan.peak / 1e9:.3f} GB, measured {peak / 1e9:.3f} GB:\n"
        + "\n".join(format_plan(plan))
    )


def _refused_before_loading(monkeypatch):
    """Loading a model raises: a refusal must come first."""

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the memory check")

    monkeypatch.setattr(run_mod, "build_model", no_load)
    monkeypatch.setattr(io, "load_llama_gguf", no_load)


def test_train_refuses_a_run_over_max_memory(tmp_path, tiny_gguf, monkeypatch):
    doc = _doc(tmp_path, tiny_gguf, training={"max_memory": "100MB"})
    _refused_before_loading(monkeypatch)
    with pytest.raises(ConfigError) as e:
        run_mod.train_from_yaml(doc, progress=False)
    msg = str(e.value)
    assert "training.max_memory" in msg and "over the budget of 0.10 GB" in msg
    for knob in ("data.batch_size", "data.seq_len", "model.remat_policy",
                 "lora.quantize_base", "model.keep_quantized", "lora.rank",
                 "model.matmul_dtype", "weights ", "step "):  # fmt: skip
        assert knob in msg
    assert not (tmp_path / "out").exists()


def test_validate_refuses_and_a_fitting_run_passes(tmp_path, tiny_gguf, monkeypatch):
    runner = CliRunner()
    doc = _doc(tmp_path, tiny_gguf, training={"max_memory": "0.1GB"})
    _refused_before_loading(monkeypatch)
    res = runner.invoke(cli, ["validate", str(doc)])
    assert res.exit_code != 0
    assert "max_memory" in res.output and "GB" in res.output
    doc = _doc(tmp_path, tiny_gguf, training={"max_memory": "64GB"})
    res = runner.invoke(cli, ["validate", str(doc)])
    assert res.exit_code == 0, res.output
    assert "Memory: peak ~" in res.output and "of max_memory 64.00 GB" in res.output


def test_info_memory_prints_the_table(tmp_path, tiny_gguf):
    doc = _doc(tmp_path, tiny_gguf, export={"formats": ["adapter", "hf"]})
    res = CliRunner().invoke(cli, ["info", "--memory", str(doc)])
    assert res.exit_code == 0, res.output
    for part in ("runtime", "weights", "adapters", "optimizer", "step",
                 "load transient", "train peak", "peak", "not counted: "):  # fmt: skip
        assert part in res.output
    res = CliRunner().invoke(cli, ["info", "--memory", "--format", "json", str(doc)])
    data = json.loads(res.output)
    assert data["peak"] == max(data["load_peak"], data["train_peak"])
    assert sum(p["bytes"] for k, p in data["parts"].items()
               if k != "load transient") == data["train_peak"]  # fmt: skip


# ---- a mixture of experts' load against its plan -------------------------------

MOE_LOAD = """
import gc, json, sys
import jax
from entrenar import io, lora
from entrenar.runs.models import base_quantizer

folder, targets = sys.argv[1], json.loads(sys.argv[2])
quantize = base_quantizer(lora.LoRAConfig(targets=targets, quantize_base="nf4"))

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

out = {}
for dtype in sys.argv[3:]:
    p = io.load_hf_folder(folder, dtype=dtype, quantize=quantize)[1]
    del p  # loaded once first: measure no compiler
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status("VmRSS")
    params = jax.block_until_ready(
        io.load_hf_folder(folder, dtype=dtype, quantize=quantize)[1]
    )
    gc.collect()
    out[dtype] = {
        "peak": status("VmHWM") - before,
        "after": status("VmRSS") - before,
        "tree": sum(x.nbytes for x in jax.tree_util.tree_leaves(params)),
    }
    del params
    gc.collect()
print(json.dumps(out))
"""
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_proj",
               "experts.up_proj", "experts.down_proj"]  # fmt: skip
STACK_BYTES = 8 * 2048 * 512 * 2
"""One layer's experts of one projection ``(E, out, in)`` in the file's bfloat16."""


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A bfloat16 Qwen3-MoE folder: 4 layers of 8 experts 2048 x 512 (0.2 GB)."""
    config = nn.architecture("qwen3_moe").make_config(
        vocab_size=320, hidden_size=512, intermediate_size=1024, num_layers=4,
        num_heads=8, num_kv_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=2048, param_dtype="bfloat16",
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("moe") / "hf"
    io.save_hf_folder(folder, config, config.init(jax.random.key(0)))
    return folder


@pytest.fixture(scope="module")
def moe_peaks(moe_folder):
    """Peak and final RSS growth of a second QLoRA load of `moe_folder`, per dtype.

    In a fresh process, big allocations mapped (``MALLOC_MMAP_THRESHOLD_``) so that
    what a load frees goes back to the system.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("COV_CORE_")}
    env.update(JAX_PLATFORMS="cpu", MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, "-c", MOE_LOAD, str(moe_folder), json.dumps(MOE_TARGETS),
         "float32", "bfloat16"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset"
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_moe_folders_load_peaks_under_its_plan(
    dtype, moe_folder, moe_peaks, tmp_path
):
    """A QLoRA load of a Mixture of experts stays under the plan, in both dtypes.

    The plan's load (weights + the leaf being read) against the measured peak over
    the process before the load. Before: the stacked experts of a layer
    (`ExpertStack`) were kept after it was quantized (two worker threads each
    dropping the same previous stack and keeping theirs, and the read ahead making
    each stack again to count its bytes), so the load ended holding 0.19 GB over
    its 0.11 GB tree on 8 layers of 16 experts 1024 x 512, and peaked at 0.39 GB in
    bfloat16 where the plan said 0.24 GB.
    """
    got = moe_peaks[dtype]
    doc = _doc(
        tmp_path, moe_folder, model={"dtype": dtype},
        lora={"targets": MOE_TARGETS}, data={"batch_size": 1},
    )  # fmt: skip
    plan = plan_memory(validate(doc), compile_step=False)
    assert plan.weights == pytest.approx(got["tree"], rel=0.02)
    planned = plan.load_peak - plan.runtime  # weights + load transient
    assert got["peak"] <= planned, (got, format_plan(plan))
    # the load ends holding its tree: no layer's stacked experts kept
    assert got["after"] < got["tree"] + STACK_BYTES // 2, got


def _pref_doc(tmp_path, path, kind, quantize):
    """A DPO or GRPO run of ``path``: LoRA on float bases, on NF4 bases, or none."""
    pairs, prompts = tmp_path / "pairs.jsonl", tmp_path / "prompts.jsonl"
    pairs.write_text("".join(
        json.dumps({"prompt": r["prompt"], "chosen": r["completion"],
                    "rejected": ROWS[i - 1]["completion"]}) + "\n"
        for i, r in enumerate(ROWS)
    ))  # fmt: skip
    prompts.write_text("".join(
        json.dumps({"prompt": r["prompt"], "answer": r["completion"].split()[0]})
        + "\n" for r in ROWS
    ))  # fmt: skip
    lora_ = {"targets": "all-linear", "quantize_base": quantize}
    if kind == "dpo":
        sections = dict(data={"train": str(pairs), "format": "preference",
                              "batch_size": 8, "seq_len": 64},
                        preference={"beta": 0.1})  # fmt: skip
    else:
        sections = dict(
            data={"train": str(prompts), "seq_len": 16, "format": "auto"},
            grpo={"num_generations": 4, "prompts_per_step": 2, "beta": 0.04,
                  "max_completion_length": 16,
                  "rewards": [{"type": "contains", "column": "answer"}]},
        )  # fmt: skip
    doc = _doc(tmp_path, path, **sections, lora=lora_)
    if quantize is None:  # full fine-tuning: no lora section, a merged export
        d = yaml.safe_load(doc.read_text())
        del d["lora"]
        d["export"] = {"formats": ["hf"]}
        doc = write(doc, d)
    return doc


PREF_PEAK = """
import json, sys
from entrenar.config import validate
from entrenar.runs import online, run
spec = validate(sys.argv[1])
if spec.grpo is not None:
    online.train_grpo(spec, progress=False)
else:
    run._train(spec, run.prepare(spec), resume=None, progress=False)
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(json.dumps({"peak": int(line.split()[1]) * 1024}))
"""


@pytest.mark.parametrize(
    "kind, quantize",
    [
        ("dpo", "nf4"),
        pytest.param("dpo", "none", marks=pytest.mark.slow),
        pytest.param("dpo", None, marks=pytest.mark.slow),
        pytest.param("grpo", "none", marks=pytest.mark.slow),
        pytest.param("grpo", "nf4", marks=pytest.mark.slow),
        pytest.param("grpo", None, marks=pytest.mark.slow),
    ],
)
def test_a_preference_run_peaks_within_its_plan(tmp_path, tiny_gguf, kind, quantize):
    """DPO and GRPO (LoRA, QLoRA, full): the plan is at or over the measured peak.

    And within `TOLERANCE` of it, both within `FIXED_NOISE`. The runs' own step is
    small here (0.01-0.05 GB), so the peak is the fixed parts (Python, JAX, the
    compiled programs: 0.6 GB), whose measured size varies by up to 0.05 GB from
    run to run and between a plain pytest and CI's coverage run (DPO full
    fine-tuning 0.511-0.524 GB, GRPO NF4 0.652-0.692 GB, DPO NF4 0.53-0.57 GB, and
    0.636 GB in CI): more than a tiny run resolves. This checks that nothing a
    preference run holds (GRPO's generation and KV cache, DPO's reference pass) is
    left out. (The step-dominated preference runs in specs/trainer.md, measured
    at context 1024, were all at or under their plans.)
    """
    doc = _pref_doc(tmp_path, tiny_gguf, kind, quantize)
    plan = plan_memory(validate(doc))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COV_CORE_")}
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR="")
    res = subprocess.run(
        [sys.executable, "-c", PREF_PEAK, str(doc)], capture_output=True, text=True,
        env=env, cwd=tmp_path, check=True,
    )  # fmt: skip
    peak = json.loads(res.stdout.strip().splitlines()[-1])["peak"]
    table = "\n".join(format_plan(plan))
    msg = f"predicted {plan.peak / 1e9:.3f} GB, measured {peak / 1e9:.3f} GB:\n{table}"
    assert peak - FIXED_NOISE <= plan.peak <= (1 + TOLERANCE) * peak + FIXED_NOISE, msg


FIXED_NOISE = 50_000_000
"""Run-to-run spread of a tiny preference run's measured peak (bytes)."""


def test_validate_plans_preference_runs(tmp_path, tiny_gguf, monkeypatch):
    """``max_memory`` on a DPO or GRPO run: a plan (it was refused / not checked)."""
    runner = CliRunner()
    _refused_before_loading(monkeypatch)
    for kind in ("dpo", "grpo"):
        doc = _pref_doc(tmp_path, tiny_gguf, kind, "nf4")
        d = yaml.safe_load(doc.read_text())
        for budget, ok in (("64GB", True), ("0.1GB", False)):
            d["training"]["max_memory"] = budget
            res = runner.invoke(cli, ["validate", str(write(doc, d))])
            assert (res.exit_code == 0) == ok, res.output
            if ok:
                assert "Memory: peak ~" in res.output, res.output
            else:
                assert "over the budget of 0.10 GB" in res.output, res.output


def test_grpo_plans_the_longest_prompt_not_seq_len(tmp_path, tiny_gguf):
    """The loop does not cut prompts: the KV cache is sized by the longest one.

    `generate`'s cache is ``round_up(prompt + max_new_tokens, 32)`` positions; a
    prompt of ``n > data.seq_len`` tokens must be planned with ``n``.
    """
    doc = _pref_doc(tmp_path, tiny_gguf, "grpo", "none")
    long = " ".join(r["prompt"] for r in ROWS[:6])
    with open(tmp_path / "prompts.jsonl", "a") as f:
        f.write(json.dumps({"prompt": long, "answer": "one"}) + "\n")
    n = len(io.load_tokenizer(WORDS / "tokenizer.gguf").encode(long, special=True))
    assert n > 16  # data.seq_len of the run
    plan = plan_memory(validate(doc))
    assert f"8 rows x {-(-(n + 16) // 32) * 32})" in plan.step_detail, plan.step_detail


def test_a_deepseek_folder_is_planned(tmp_path):
    """DeepSeek's layers are a list of unstacked layers: the plan walks them.

    Before, `plan_memory` read the list as a shape (TypeError in memory_tree).
    """
    config = dataclasses.replace(nn.architecture("deepseek_v3").tiny(), vocab_size=320)
    folder = tmp_path / "hf"
    io.save_hf_folder(folder, config, config.init(jax.random.key(0)))
    targets = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    doc = _doc(tmp_path, folder, lora={"targets": targets, "quantize_base": "none"})
    plan = plan_memory(validate(doc), compile_step=False)
    _, params = io.load_hf_folder(folder)
    assert plan.weights == tree_bytes(params)


# ---- full fine-tuning: the trainable half updated in place, checkpoint included ----

FULL_BYTES = 244_000_000
"""About the float32 trainable half of `full_folder` (61M parameters)."""


@pytest.fixture(scope="module")
def full_folder(tmp_path_factory):
    """A bfloat16 Llama folder of 61M random parameters, trained in float32."""
    config = nn.LlamaConfig(
        vocab_size=320, hidden_size=1024, intermediate_size=4096, num_layers=4,
        num_heads=8, num_kv_heads=2, max_position_embeddings=64,
        param_dtype="bfloat16",
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("full") / "hf"
    io.save_hf_folder(folder, config, config.init(jax.random.key(0)))
    return folder


@pytest.mark.slow
def test_a_full_fine_tuning_run_with_its_checkpoint_peaks_within_its_plan(
    tmp_path, full_folder
):
    """Full fine-tuning in float32 from a bfloat16 folder, checkpoint at the end.

    The plan (runtime, weights, optimizer state, the step with the trainable half
    donated) is at or over the measured peak of the run, which writes its
    checkpoint (orbax) after the last step. Before, each of two copies of the state
    put the run over its plan: the load hands the run arrays that alias its host
    buffers, which XLA cannot donate, so the first step wrote its new parameters
    beside the old ones (a second trainable half: 1.2 GB of a 4-layer TinyLlama in
    float32); and orbax held zstd-compressed copies of the whole state while it
    wrote the checkpoint (0.93 of the state's bytes; the plan counts neither).
    """
    doc = _doc(
        tmp_path, full_folder, model={"dtype": "float32"},
        data={"batch_size": 1, "seq_len": 64},
    )  # fmt: skip
    d = yaml.safe_load(doc.read_text())
    del d["lora"]
    d["export"] = {"formats": []}
    doc = write(doc, d)
    plan = plan_memory(validate(doc))
    assert plan.weights == pytest.approx(FULL_BYTES, rel=0.05)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COV_CORE_")}
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR="")
    res = subprocess.run(
        [sys.executable, "-c", PEAK, str(doc)], capture_output=True, text=True,
        env=env, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert os.listdir(tmp_path / "out" / "checkpoints") == ["2"]
    peak = json.loads(res.stdout.strip().splitlines()[-1])["peak"]
    table = "\n".join(format_plan(plan))
    msg = f"predicted {plan.peak / 1e9:.3f} GB, measured {peak / 1e9:.3f} GB:\n{table}"
    assert peak <= plan.peak <= (1 + TOLERANCE) * peak + FIXED_NOISE, msg
