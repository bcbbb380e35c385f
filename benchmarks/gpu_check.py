"""The GPU check of issue 32: numerics against the CPU, LoRA/QLoRA steps against a peer.

One command on a machine with a GPU (`make gpu-check`) writes
``benchmarks/results/gpu.md`` within a time budget (``--budget``, 450 s by default,
so the whole run stays under 8 minutes); ``--cpu-smoke`` runs the same sections with
tiny shapes on the CPU (tests/test_gpu_check.py, so the script never rots).

Sections, each in its own subprocess (a failure is written into the report and the
next section runs; a section that would start after the budget is listed as
skipped):

1. **numerics**: each decoder family's logits and parameter gradients (padding,
   packed segments), a LoRA step, a QLoRA step (NF4, double quantization) and three
   optimizers (SGD with momentum, Adam, AdamW over three steps), computed once on the
   CPU (``JAX_PLATFORMS=cpu``: the reference, native kernels and all) and once on the
   device with ``jax_default_matmul_precision=highest``; every array must agree to
   ``1e-4`` of its largest value. Fused attention in bfloat16 (cuDNN's kernel where
   it takes the call) is compared with the float32 reference to bfloat16 rounding.
2. **checkpoint**: the LoRA step's `TrainState` saved on the device
   (`entrenar.train.Checkpointer`), restored in a CPU-only process, equal bit for bit.
3. **steps**: LoRA and QLoRA (rank 16 on every projection, AdamW, chunked loss,
   bfloat16 weights and activations, `entrenar.train.make_train_step`, which donates
   the state) at the shapes of SmolLM2-135M, TinyLlama-1.1B and Llama-3-8B with
   random weights made on the device (a QLoRA base is made and quantized one layer
   at a time, so no dense copy of it ever exists), batch 4 x 2048 and 1 x 512;
   seconds per step (median after two warm-up steps), tokens/s, model FLOP/s
   utilization against the device's bf16 matmul rate measured in the same process
   (8192^3), peak device memory (`Device.memory_stats`). The same shapes in
   PyTorch + PEFT (benchmarks/torch_peer_lora.py) on the same device.

    python benchmarks/gpu_check.py                 # on the GPU machine
    python3 benchmarks/gpu_check.py --out $OUT/gpu.md   # the lent machine: the
                                                        # report comes back in $OUT
    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gpu.md

The lent machine gives 15 minutes of device time, starts included: two calls, each
with its own start, leave room to mend what the first shows before the second
(``--shapes`` picks shapes, ``--skip-numerics`` leaves the numerics out):

    python3 benchmarks/gpu_check.py --out $OUT/gpu.md --shapes llama3-8b --budget 370
    python3 benchmarks/gpu_check.py --out $OUT/gpu.md --skip-numerics \
        --shapes tinyllama-1.1b,smollm2-135m --budget 300
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name: vocab, hidden, intermediate, layers, heads, kv heads, tied, rope theta
SHAPES: dict[str, tuple[int, int, int, int, int, int, bool, float]] = {
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8, False, 500000.0),
    "tinyllama-1.1b": (32000, 2048, 5632, 22, 32, 4, False, 10000.0),
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, True, 100000.0),
}
SMOKE_SHAPES = {"tiny": (256, 64, 128, 2, 4, 2, False, 10000.0)}
BATCHES = ((1, 512), (4, 2048))
SMOKE_BATCHES = ((1, 16),)
SMOKE_FAMILIES = ("gemma3",)  # sliding and full layers, qk-norm, GQA


# ======================================================================= workers
def _jax(device: bool, smoke: bool) -> Any:
    import jax

    jax.config.update("jax_numpy_dtype_promotion", "standard")
    if smoke:  # tiny programs: compile time is all there is
        jax.config.update("jax_disable_most_optimizations", True)
    if device:
        jax.config.update("jax_default_matmul_precision", "highest")
    return jax


def _host(tree: Any) -> dict[str, Any]:
    """Leaves of ``tree`` as numpy arrays keyed by their paths (floats in float64).

    A PRNG key leaf becomes its key data (uint32).
    """
    import jax
    import numpy as np

    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.asarray(leaf)
        floating = a.dtype.kind == "f" or a.dtype.name == "bfloat16"
        out[jax.tree_util.keystr(path)] = a.astype(np.float64) if floating else a
    return out


def numerics_outputs(smoke: bool) -> dict[str, Any]:
    """Named arrays of every numerics check, computed on JAX's default device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from entrenar import lora, nn, optim

    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    families = [a.name for a in nn.architectures() if a.config_class is nn.LlamaConfig]
    if smoke:
        families = [f for f in families if f in SMOKE_FAMILIES]
    t = 12
    for fam in families:
        cfg = nn.architecture(fam).tiny()
        shapes = cfg.param_shapes()
        params = jax.tree_util.tree_map(
            lambda s: jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32) + 0.02,
            shapes,
            is_leaf=lambda s: isinstance(s, tuple),
        )  # made on the host: the same numbers on both backends
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, t)), jnp.int32)
        mask = np.ones((2, t), bool)
        mask[1, :3] = False
        seg = np.array([[0] * 5 + [1] * (t - 5), [0] * t])

        def loss(p, cfg=cfg, tokens=tokens, mask=mask, seg=seg):
            z = cfg.apply(
                p, tokens, mask=jnp.asarray(mask), segment_ids=jnp.asarray(seg)
            )
            return jnp.mean(jnp.where(jnp.asarray(mask)[..., None], z, 0.0) ** 2), z

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        out[f"family {fam}: logits"] = {"": np.asarray(logits, np.float64)}
        out[f"family {fam}: gradients"] = _host(grads)

    # LoRA and QLoRA steps: two SGD-momentum steps (linear in the gradient: no Adam
    # epsilon to magnify rounding) of a tiny Llama; Adam is checked below
    base = step_config()
    shapes = base.param_shapes()
    params = jax.tree_util.tree_map(
        lambda s: jnp.asarray(0.05 * rng.standard_normal(s), jnp.float32),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )
    tokens = jnp.asarray(rng.integers(0, base.vocab_size, (2, t)), jnp.int32)
    states = {}
    for name, q in (("lora", None), ("qlora", "nf4")):
        lcfg = lora.LoRAConfig(rank=4, alpha=8.0, targets=TARGETS)
        p = lora.apply(params, lcfg, key=jax.random.key(1), quantize=q)
        p = _host_adapters(p, rng)  # B non-zero, the same numbers on both sides
        tx = optim.sgd(0.1, momentum=0.9)  # linear in g: no eps to amplify
        state, step = _train_step(base, p, tx, chunk=8)
        losses_ = []
        for _ in range(2):
            state, m = step(state, {"input_ids": tokens})
            losses_.append(float(m["loss"]))
        out[f"{name} step: loss"] = {"": np.asarray(losses_)}
        out[f"{name} step: adapters"] = _host(state.trainable)
        states[name] = state

    # optimizers: three updates of a random tree
    tree = {
        "a": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((16,)), jnp.float32),
    }
    grads = [
        jax.tree_util.tree_map(
            lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), tree
        )
        for _ in range(3)
    ]
    for name, tx in (
        ("sgd", optim.sgd(0.1, momentum=0.9)),
        ("adam", optim.adam(1e-2)),
        ("adamw", optim.adamw(1e-2, weight_decay=0.1)),
    ):
        p, s = tree, tx.init(tree)
        for g in grads:
            p, s = optim.apply_gradients(tx, g, s, p)
        out[f"optimizer {name}"] = _host(p)
    out["_state"] = states["lora"]
    return out


def _host_adapters(params: Any, rng: Any) -> Any:
    """Every LoRA ``a`` and ``b`` replaced by host random numbers (b non-zero)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from entrenar.lora import LoRAWeight

    def fill(w: Any) -> Any:
        if not isinstance(w, LoRAWeight):
            return w
        a = jnp.asarray(0.1 * rng.standard_normal(w.a.shape), w.a.dtype)
        b = jnp.asarray(0.1 * rng.standard_normal(w.b.shape), w.b.dtype)
        return dataclasses.replace(w, a=a, b=b)

    return jax.tree_util.tree_map(
        fill, params, is_leaf=lambda x: isinstance(x, LoRAWeight)
    )


def _train_step(cfg: Any, params: Any, tx: Any, chunk: int) -> tuple[Any, Any]:
    """A `TrainState` of LoRA ``params`` and `make_train_step` of the chunked loss."""
    import jax

    from entrenar import train
    from entrenar.nn import losses

    def loss_fn(p: Any, batch: Any, *, key: Any) -> Any:
        tokens = batch["input_ids"]
        return losses.chunked_causal_lm_loss(
            cfg.features(p, tokens),
            cfg.output_weight(p),
            tokens,
            chunk=chunk,
            matmul_dtype=cfg.matmul_dtype,
        )

    state = train.TrainState.create(params, tx, key=jax.random.key(0), trainable="lora")
    return state, train.make_train_step(loss_fn, tx)


def worker_numerics(a: argparse.Namespace) -> dict[str, Any]:
    """CPU: save the reference. Device: compare, check fused attention, checkpoint."""
    import numpy as np

    jax = _jax(device=a.role == "device", smoke=a.smoke)
    got = numerics_outputs(a.smoke)
    state = got.pop("_state")
    flat = {f"{k}|{p}": v for k, d in got.items() for p, v in d.items()}
    info = {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
    }
    if a.role == "cpu":
        np.savez(a.npz, **flat)
        return info
    np.savez(a.npz + ".device.npz", **flat)  # compared once the CPU's is written
    rows = []
    try:
        rows.append(_fused_attention_check())
    except Exception as e:  # cuDNN may refuse it only when compiling
        rows.append(
            {
                "check": "fused attention, bf16",
                "max_rel_err": float("nan"),
                "ok": False,
                "error": f"{type(e).__name__}: {str(e)[:300]}",
            }
        )
    try:
        rows.append(_blocked_check(a.smoke))
    except Exception as e:
        rows.append(
            {
                "check": "blocked NF4 matmul",
                "max_rel_err": float("nan"),
                "ok": False,
                "error": f"{type(e).__name__}: {str(e)[:300]}",
            }
        )
    # checkpoint: save the LoRA step's state here; a CPU process restores it
    from entrenar import train

    ck = train.Checkpointer(a.ckpt)
    ck.save(state, {"check": "gpu"})
    ck.close()
    np.savez(a.npz + ".state.npz", **_host(_saved(state)))
    return {**info, "rows": rows}


def compare(ref_npz: str, dev_npz: str) -> list[dict[str, Any]]:
    """One row per check: its largest |device - CPU| relative to the array's max."""
    import numpy as np

    ref, dev = np.load(ref_npz), np.load(dev_npz)
    worst: dict[str, float] = {}
    for key in dev.files:
        name = key.split("|", 1)[0]
        r, v = ref[key], dev[key]
        scale = max(float(np.abs(r).max(initial=0.0)), 1e-30)
        err = float(np.abs(v - r).max(initial=0.0)) / scale
        worst[name] = max(worst.get(name, 0.0), err)
    missing = sorted(set(ref.files) ^ set(dev.files))
    rows = [{"check": n, "max_rel_err": e, "ok": e <= TOL} for n, e in worst.items()]
    if missing:
        rows.append({"check": "arrays on one side only", "max_rel_err": float("nan"),
                     "ok": False, "error": ", ".join(missing)[:300]})  # fmt: skip
    return rows


def _fused_attention_check() -> dict[str, Any]:
    """bfloat16 fused attention (cuDNN where it takes it) vs the float32 reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from entrenar.nn import attention
    from entrenar.nn.fused_attention import fused_attention

    rng = np.random.default_rng(3)
    b, t, h, kv, d = 2, 256, 8, 2, 64
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((b, t, h, d), (b, t, kv, d), (b, t, kv, d))
    )
    mask = attention.causal_mask(jnp.arange(t), t)
    f = jax.jit(
        lambda q, k, v: fused_attention(q, k, v, causal=True, matmul_dtype="bfloat16")
    )
    r = jax.jit(
        lambda q, k, v: attention._attention_jax(q, k, v, mask, None, d**-0.5, None)
    )
    hlo = f.lower(q, k, v).compile().as_text() or ""
    err = float(jnp.abs(f(q, k, v) - r(q, k, v)).max() / jnp.abs(r(q, k, v)).max())
    cudnn = "cudnn" in hlo.lower() or "__cudnn$fmha" in hlo
    return {
        "check": f"fused attention, bf16 ({'cuDNN' if cudnn else 'XLA'}) vs f32",
        "max_rel_err": err,
        "ok": err <= 2e-2,
    }


def _saved(state: Any) -> Any:
    """What a checkpoint holds: the trained half, optimizer state, step, key.

    The frozen half (the base model) is not checkpointed; it comes from the template.
    """
    return (state.trainable, state.opt_state, state.step, state.key)


def _blocked_check(smoke: bool) -> dict[str, Any]:
    """The blocked NF4 matmul (`entrenar.quant.blocked`) vs the dense form.

    At Llama-3-8B's ``down_proj`` shape (4096 x 14336, NF4 with double quantization,
    512 input rows, bfloat16 products): the product and input gradient agree to
    bfloat16 summation order, and the compiled temporaries of both forms (XLA's
    `memory_analysis`) show whether a dense copy of the weight is made.
    """
    import jax
    import jax.numpy as jnp

    from entrenar import quant
    from entrenar.nn.linear import lowp_matmul
    from entrenar.quant.blocked import blocked_matmul
    from entrenar.quant.linear import dequantized

    out, fan_in, n = (256, 512, 64) if smoke else (4096, 14336, 512)
    w = quant.quantize(
        0.02 * jax.random.normal(jax.random.key(0), (out, fan_in)), "nf4",
        double_quant=True,
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (n, fan_in))

    def blocked(x: Any, w: Any) -> Any:
        return jnp.sum(jnp.sin(blocked_matmul(w, x, "bfloat16")))

    def dense(x: Any, w: Any) -> Any:
        return jnp.sum(jnp.sin(lowp_matmul(x, w, "bfloat16", dequantized)))

    def temp_mb(f: Any) -> float:
        m = jax.jit(f).lower(x, w).compile().memory_analysis()
        return float("nan") if m is None else m.temp_size_in_bytes / 1e6

    gb, gd = jax.jit(jax.grad(blocked))(x, w), jax.jit(jax.grad(dense))(x, w)
    err = float(jnp.abs(gb - gd).max() / jnp.abs(gd).max())
    vb, vd = jax.jit(blocked)(x, w), jax.jit(dense)(x, w)
    err = max(err, float(jnp.abs(vb - vd) / jnp.abs(vd)))
    mem = (temp_mb(dense), temp_mb(blocked), temp_mb(jax.grad(dense)),
           temp_mb(jax.grad(blocked)))  # fmt: skip
    return {
        "check": f"blocked NF4 matmul {out}x{fan_in}, {n} rows, vs dense (bf16; "
        f"temporaries MB dense/blocked: forward {mem[0]:.3g}/{mem[1]:.3g}, "
        f"gradient {mem[2]:.3g}/{mem[3]:.3g}; dense bf16 weight "
        f"{out * fan_in * 2 / 1e6:.3g})",
        "max_rel_err": err,
        "ok": err <= 2e-2,
    }


def worker_restore(a: argparse.Namespace) -> dict[str, Any]:
    """CPU only: restore the device's checkpoint, compare with its saved arrays."""
    import numpy as np

    jax = _jax(device=False, smoke=a.smoke)
    from entrenar import train

    ck = train.Checkpointer(a.ckpt, read_only=True)
    step = ck.latest_step()
    want = np.load(a.npz + ".state.npz")
    # the template: the same tree (zeros) made in this CPU-only process
    restored, meta = ck.restore(numerics_template(), step)
    got = _host(_saved(restored))
    f64 = np.float64
    worst = max(
        float(np.abs(got[k].astype(f64) - want[k].astype(f64)).max(initial=0.0))
        for k in want
    )
    return {
        "backend": jax.default_backend(),
        "step": step,
        "meta": meta,
        "arrays": len(want),
        "max_abs_diff": worst,
        "ok": worst == 0.0 and set(got) == set(want),
    }


def step_config() -> Any:
    """The numerics' LoRA/QLoRA model: a tiny Llama whose inputs are NF4 blocks."""
    from entrenar.nn import LlamaConfig

    return LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )


def numerics_template() -> Any:
    """A `TrainState` shaped like the numerics LoRA step's (values unused)."""
    import jax
    import jax.numpy as jnp

    from entrenar import lora, optim

    base = step_config()
    params = jax.tree_util.tree_map(
        lambda s: jnp.zeros(s, jnp.float32),
        base.param_shapes(),
        is_leaf=lambda s: isinstance(s, tuple),
    )
    p = lora.apply(
        params,
        lora.LoRAConfig(rank=4, alpha=8.0, targets=TARGETS),
        key=jax.random.key(1),
    )
    state, _ = _train_step(base, p, optim.sgd(0.1, momentum=0.9), chunk=8)
    return state


# ------------------------------------------------------------------ the steps
def model_config(shape: tuple[Any, ...], smoke: bool) -> Any:
    from entrenar.nn import LlamaConfig

    vocab, hidden, inter, layers, heads, kv, tied, theta = shape
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        tie_word_embeddings=tied,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        dtype="bfloat16",
        param_dtype="bfloat16",
        matmul_dtype="bfloat16",
    )


def device_params(cfg: Any, qlora: bool) -> Any:
    """Random bfloat16 weights made on the device; a QLoRA base one layer at a time.

    Each stacked projection of a QLoRA base is made and quantized (NF4, double
    quantization) layer by layer inside one `jax.lax.map`, so no dense copy of the
    stack exists; the embeddings, norms and head stay bfloat16.
    """
    import jax
    import jax.numpy as jnp

    from entrenar import quant

    std = cfg.initializer_range
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        cfg.param_shapes(), is_leaf=lambda s: isinstance(s, tuple)
    )

    def quantized(key: Any, shape: tuple[int, ...]) -> Any:
        def one(k: Any) -> Any:  # one layer's (out, in), made and quantized
            w = std * jax.random.normal(k, shape[1:], jnp.bfloat16)
            return quant.quantize(w, "nf4", double_quant=True)

        return jax.lax.map(one, jax.random.split(key, shape[0]))

    @jax.jit
    def make(key: Any) -> list[Any]:  # one program: one compilation
        leaves = []
        for i, (path, shape) in enumerate(flat):
            name = jax.tree_util.keystr(path)
            k = jax.random.fold_in(key, i)
            if "norm" in name:
                leaves.append(jnp.ones(shape, jnp.bfloat16))
            elif qlora and "_proj" in name and len(shape) == 3:
                leaves.append(quantized(k, shape))
            else:  # made in bfloat16: no float32 copy of the embeddings
                leaves.append(std * jax.random.normal(k, shape, jnp.bfloat16))
        return leaves

    leaves = make(jax.random.key(0))
    jax.block_until_ready(leaves)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def step_flops(shape: tuple[Any, ...], batch: int, seq: int) -> float:
    """FLOPs a LoRA step must do: ``4 P n`` + attention + adapters.

    ``P``: weights of the projections and the head (the embedding lookup is no
    matmul); forward ``2 P n`` and the input gradients ``2 P n`` (no gradient of a
    frozen weight); attention's two products forward and four backward over the
    causal half, ``6 · 2 B T² H d / 2`` per layer; the adapters ``6 r (in + out) n``.
    """
    vocab, hidden, inter, layers, heads, kv, _, _ = shape
    d = hidden // heads
    n = batch * seq
    proj = [
        (hidden, heads * d),
        (hidden, kv * d),
        (hidden, kv * d),
        (heads * d, hidden),
        (hidden, inter),
        (hidden, inter),
        (inter, hidden),
    ]
    p = layers * sum(i * o for i, o in proj) + vocab * hidden
    attn = layers * 6 * batch * seq * seq * heads * d
    adapters = layers * sum(6 * RANK * (i + o) * n for i, o in proj)
    return float(4 * p * n + attn + adapters)


def matmul_rate(smoke: bool) -> float:
    """bf16 FLOP/s of one ``m³`` product (float32 accumulation), best of 10."""
    import jax
    import jax.numpy as jnp

    m = 256 if smoke else 8192
    a = jnp.ones((m, m), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * m**3 / best


def _peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def worker_steps(a: argparse.Namespace) -> dict[str, Any]:
    """QLoRA, then LoRA, of one shape and batch in this process (one JSON)."""
    import dataclasses

    jax = _jax(device=False, smoke=a.smoke)
    import jax.numpy as jnp

    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    shape = shapes[a.shape]
    cfg = model_config(shape, a.smoke)
    rate = matmul_rate(a.smoke)
    flops = step_flops(shape, a.batch, a.seq)
    out: dict[str, Any] = {
        "shape": a.shape,
        "batch": a.batch,
        "seq": a.seq,
        "matmul_rate": rate,
        "flops": flops,
        "device": str(jax.devices()[0]),
    }
    steps = 2 if a.smoke else 3
    for variant in ("qlora", "lora"):  # QLoRA first: its peak is not LoRA's
        try:
            out[variant] = _run_variant(cfg, variant, a, steps)
        except Exception as e:
            # fused attention is the new part: measure the rest without it
            out[variant] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            try:
                ref = dataclasses.replace(cfg, attention_impl="reference")
                out[variant] = _run_variant(ref, variant, a, steps)
                out[variant]["note"] = "reference attention; fused: " + (
                    f"{type(e).__name__}: {str(e)[:200]}"
                )
            except Exception as e2:
                out[variant]["error"] += f"; reference: {type(e2).__name__}: {e2}"
        if "step_s" in out[variant]:
            sec = out[variant]["step_s"]
            out[variant]["mfu"] = flops / sec / rate
        jnp.zeros(()).block_until_ready()
    return out


def _run_variant(cfg: Any, variant: str, a: argparse.Namespace, steps: int) -> Any:
    """Make the weights, compile and time the step; the figures of one variant."""
    import jax

    from entrenar import lora, optim

    params = device_params(cfg, variant == "qlora")
    lcfg = lora.LoRAConfig(rank=RANK, alpha=2.0 * RANK, targets=TARGETS)
    params = lora.apply(params, lcfg, key=jax.random.key(1))
    state, step = _train_step(cfg, params, optim.adamw(1e-4), chunk=min(1024, a.seq))
    del params
    tokens = jax.random.randint(jax.random.key(2), (a.batch, a.seq), 0, cfg.vocab_size)
    setup_peak = _peak_bytes()
    t0 = time.perf_counter()
    state, m = step(state, {"input_ids": tokens})
    float(m["loss"])
    first_s = time.perf_counter() - t0  # compilation and one step
    times = []
    for i in range(steps + 1):  # the first is a second warm-up
        t0 = time.perf_counter()
        state, m = step(state, {"input_ids": tokens})
        loss = float(m["loss"])  # waits for the step
        if i >= 1:
            times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    return {
        "step_s": sec,
        "tokens_per_s": a.batch * a.seq / sec,
        "loss": loss,
        "first_step_s": first_s,
        "setup_peak_bytes": setup_peak,
        "peak_bytes": _peak_bytes(),
        "attention": "fused" if cfg.uses_fused_attention() else "reference",
    }


# ================================================================= orchestrator
class Report:
    """The markdown report, rewritten after every section."""

    def __init__(self, path: Path, smoke: bool) -> None:
        self.path, self.smoke = path, smoke
        self.parts: list[str] = []
        self.started = time.time()

    def add(self, text: str) -> None:
        self.parts.append(text.rstrip() + "\n")
        self.write()

    def replace(self, heading: str, text: str) -> None:
        """Drop the parts that start with ``heading``, then add ``text``."""
        self.parts = [p for p in self.parts if not p.startswith(heading)]
        self.add(text)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.parts))


def start_worker(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """This script as a worker process (`finish_worker` collects its answer)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def finish_worker(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The worker's last stdout line as JSON; killed after ``timeout`` seconds."""
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout:.0f} s)"
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"worker {proc.args[2:4]} exited {proc.returncode}: {err[-1500:]}"
        )
    return json.loads(lines[-1])


def run_worker(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run this script as a worker; its last stdout line as JSON."""
    return finish_worker(start_worker(args, env), timeout)


def _env(cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # peaks are the allocator's own
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _gb(x: Any) -> str:
    return "n/a" if x is None else f"{x / 1e9:.2f}"


def section_numerics(a: argparse.Namespace, rep: Report, left: float, tmp: str) -> None:
    npz, ckpt = os.path.join(tmp, "ref.npz"), os.path.join(tmp, "ckpt")
    flags = ["--smoke"] if a.cpu_smoke else []
    common = [*flags, "--npz", npz, "--ckpt", ckpt]
    # the CPU reference runs beside the device's worker (the machine's other cores)
    t0 = time.time()
    cpu_proc = start_worker(
        ["--worker", "numerics", "--role", "cpu", *common], _env(True)
    )
    try:
        dev = run_worker(
            ["--worker", "numerics", "--role", "device", *common],
            _env(a.cpu_smoke),
            left,
        )
    except BaseException:  # no reference left running into the next section
        cpu_proc.kill()
        cpu_proc.communicate()
        raise
    cpu = finish_worker(cpu_proc, left - (time.time() - t0))
    dev["rows"] = compare(npz, npz + ".device.npz") + dev["rows"]
    lines = [
        "## Numerics: device vs CPU reference",
        "",
        f"Device: {', '.join(dev['devices'])} (backend {dev['backend']}, jax "
        f"{dev['jax']}); reference: {cpu['backend']} (`JAX_PLATFORMS=cpu`). Device "
        f"at `jax_default_matmul_precision=highest`; each check's largest |device - "
        f"CPU| over its arrays, relative to the array's largest |value|; "
        f"bound {TOL:g}.",
        "",
        "| check | max rel. error | ok |",
        "| --- | ---: | --- |",
    ]
    for r in dev["rows"]:
        ok = (
            "yes" if r["ok"] else "**NO**" + (f": {r['error']}" if "error" in r else "")
        )
        lines.append(f"| {r['check']} | {r['max_rel_err']:.2e} | {ok} |")
    rep.add("\n".join(lines))
    res = run_worker(["--worker", "restore", *common], _env(True), left)
    rep.add(
        "## Checkpoint: saved on the device, restored on the CPU\n\n"
        f"LoRA step state (`entrenar.train.Checkpointer`, step {res['step']}): "
        f"{res['arrays']} arrays restored in a `JAX_PLATFORMS=cpu` process, largest "
        f"difference {res['max_abs_diff']:g}: "
        f"{'equal' if res['ok'] else '**NOT EQUAL**'}."
    )


def section_steps(
    a: argparse.Namespace,
    rep: Report,
    shape: str,
    batch: tuple[int, int],
    left: float,
    rows: list[dict[str, Any]],
) -> None:
    flags = ["--smoke"] if a.cpu_smoke else []
    r = run_worker(
        [
            "--worker",
            "steps",
            *flags,
            "--shape",
            shape,
            "--batch",
            str(batch[0]),
            "--seq",
            str(batch[1]),
        ],
        _env(a.cpu_smoke),
        left,
    )
    rows.append(r)
    rep.replace("## Steps", _steps_table(rows))


def _steps_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Steps: entrenar LoRA / QLoRA",
        "",
        "Rank 16 on q/k/v/o/gate/up/down, AdamW, bf16 weights and activations, "
        "chunked loss, `make_train_step` (donated state). MFU: "
        "`step_flops` (4 P n + causal attention + adapters) / step time / the bf16 "
        "matmul rate measured in the same process. Peak: `memory_stats()` "
        "`peak_bytes_in_use` after the variant ran (QLoRA runs first; LoRA's is the "
        "process's peak, which its own weights set).",
        "",
        "| shape | batch | variant | s/step | tokens/s | MFU | peak GB "
        "| set-up peak GB | first step s | attention | matmul TFLOP/s | loss |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: "
        "| ---: |",
    ]
    notes = []
    for r in rows:
        for v in ("lora", "qlora"):
            x = r.get(v, {})
            where = f"| {r['shape']} | {r['batch']}x{r['seq']} | {v} |"
            if "step_s" not in x:
                err = x.get("error", "did not run")[:300]
                lines.append(f"{where} error: {err} | | | | | | | | |")
                continue
            lines.append(
                f"{where} {x['step_s']:.4f} | {x['tokens_per_s']:.0f} | "
                f"{100 * x['mfu']:.1f}% | {_gb(x['peak_bytes'])} | "
                f"{_gb(x['setup_peak_bytes'])} | {x['first_step_s']:.1f} | "
                f"{x['attention']} | {r['matmul_rate'] / 1e12:.1f} | {x['loss']:.3f} |"
            )
            if "note" in x:
                notes.append(f"- {r['shape']} {r['batch']}x{r['seq']} {v}: {x['note']}")
    lines += ["", *notes] if notes else []
    return "\n".join(lines)


def section_peer(
    a: argparse.Namespace,
    rep: Report,
    cases: list[tuple[str, int, int]],
    left: float,
    rows: list[dict[str, Any]],
) -> None:
    shapes = SMOKE_SHAPES if a.cpu_smoke else SHAPES
    args = [
        str(ROOT / "benchmarks" / "torch_peer_lora.py"),
        "--steps",
        "2" if a.cpu_smoke else "3",
        "--device",
        "cpu" if a.cpu_smoke else "cuda",
    ]
    for name, b, t in cases:
        v, h, i, n, nh, kv, tied, theta = shapes[name]
        args += [
            "--case",
            json.dumps(
                dict(
                    name=name,
                    vocab=v,
                    hidden=h,
                    intermediate=i,
                    layers=n,
                    heads=nh,
                    kv_heads=kv,
                    tied=tied,
                    rope_theta=theta,
                    batch=b,
                    seq=t,
                )
            ),
        ]
    try:
        proc = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=max(1.0, left),
            env=_env(False),
        )
        text, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        text = (
            (e.stdout or b"").decode()
            if isinstance(e.stdout, bytes)
            else (e.stdout or "")
        )
        err = "timed out"
    got = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    if not got:
        raise RuntimeError(f"the peer printed nothing: {err[-1500:]}")
    rows.extend(got)
    rep.replace("## Peer", _peer_table(rows))


def _peer_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Peer: PyTorch + PEFT LoRA, same device",
        "",
        "`benchmarks/torch_peer_lora.py`: LlamaForCausalLM in bf16 (weights made on "
        "the device), SDPA attention, PEFT LoRA rank 16 on the same seven "
        "projections, torch.optim.AdamW; peak `torch.cuda.max_memory_allocated`. "
        "No QLoRA peer: bitsandbytes is not on the machine.",
        "",
        "| shape | batch | s/step | tokens/s | peak GB | loss |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        where = f"| {r['name']} | {r['batch']}x{r['seq']} |"
        if "error" in r:
            lines.append(f"{where} error: {r['error'][:200]} | | | |")
        else:
            lines.append(
                f"{where} {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | "
                f"{_gb(r['peak_bytes'])} | {r['loss']:.3f} |"
            )
    return "\n".join(lines)


def _ratios(steps: list[dict[str, Any]], peer: list[dict[str, Any]]) -> str:
    """Entrenar / peer seconds per step, and QLoRA / LoRA, where both ran."""
    lines = [
        "## Ratios (targets: LoRA <= 0.8x the peer; QLoRA <= 1.3x LoRA; 8B QLoRA "
        "1x512 peak <= 8 GB; 8B 4x2048 MFU >= 40%)",
        "",
        "| shape | batch | LoRA / peer | QLoRA / LoRA |",
        "| --- | --- | ---: | ---: |",
    ]
    by_peer = {(p["name"], p["batch"], p["seq"]): p for p in peer if "step_s" in p}
    for r in steps:
        lo, ql = r.get("lora", {}), r.get("qlora", {})
        p = by_peer.get((r["shape"], r["batch"], r["seq"]))
        vs_peer = f"{lo['step_s'] / p['step_s']:.2f}" if p and "step_s" in lo else "n/a"
        q_l = (
            f"{ql['step_s'] / lo['step_s']:.2f}"
            if "step_s" in lo and "step_s" in ql
            else "n/a"
        )
        lines.append(f"| {r['shape']} | {r['batch']}x{r['seq']} | {vs_peer} | {q_l} |")
    return "\n".join(lines)


def default_out(cpu_smoke: bool) -> Path:
    """results/gpu.md for a device run; a smoke run's report never goes there.

    results/gpu.md is what issue 32 reads as the device's figures: a CPU smoke run
    that wrote it (as it did until session 22) could be committed as GPU results.
    """
    if cpu_smoke:
        return Path(tempfile.gettempdir()) / "entrenar-gpu-check-smoke.md"
    return ROOT / "benchmarks" / "results" / "gpu.md"


def orchestrate(a: argparse.Namespace) -> int:
    out = Path(a.out) if a.out else default_out(a.cpu_smoke)
    rep = Report(out, a.cpu_smoke)
    t0 = time.time()
    mode = "--cpu-smoke (tiny shapes on the CPU)" if a.cpu_smoke else "GPU"
    rep.add(
        "# GPU check (issue 32)\n\n"
        f"`python benchmarks/gpu_check.py{' --cpu-smoke' if a.cpu_smoke else ''}`, "
        f"{mode}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"budget {a.budget:.0f} s; written by benchmarks/gpu_check.py."
    )
    shapes = list(SMOKE_SHAPES if a.cpu_smoke else SHAPES)
    if a.shapes:
        wanted = a.shapes.split(",")
        unknown = set(wanted) - set(shapes)
        if unknown:
            sys.exit(f"--shapes: unknown {sorted(unknown)}; known: {shapes}")
        shapes = [s for s in shapes if s in wanted]
    batches = SMOKE_BATCHES if a.cpu_smoke else BATCHES
    steps: list[dict[str, Any]] = []
    peer: list[dict[str, Any]] = []
    have_torch = _has("torch") and _has("peft") and _has("transformers")
    with tempfile.TemporaryDirectory() as tmp:
        if not a.cpu_smoke:  # the weights' program, shared by a shape's two batches
            os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tmp, "jax-cache")
            os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
        plan: list[tuple[str, Any]] = []
        if not a.skip_numerics:
            plan.append(("numerics", lambda left: section_numerics(a, rep, left, tmp)))
        for name in shapes:  # the 8B shape first: the headline figures
            for b in batches:
                plan.append(
                    (
                        f"steps {name} {b[0]}x{b[1]}",
                        lambda left, n=name, b=b: section_steps(
                            a, rep, n, b, left, steps
                        ),
                    )
                )
            if have_torch:
                cases = [(name, b, t) for b, t in batches]
                plan.append(
                    (
                        f"peer {name}",
                        lambda left, c=cases: section_peer(a, rep, c, left, peer),
                    )
                )
        failures = 0
        for title, run in plan:
            left = a.budget - (time.time() - t0)
            if left < 20:
                rep.add(
                    f"## {title}\n\nskipped: the time budget ({a.budget:.0f} s) "
                    "is spent."
                )
                continue
            t1 = time.time()
            try:
                run(left)
            except Exception as e:
                failures += 1
                rep.add(
                    f"## {title}: FAILED\n\n```\n{type(e).__name__}: "
                    f"{str(e)[-2000:]}\n{traceback.format_exc()[-1500:]}\n```"
                )
            print(f"{title}: {time.time() - t1:.1f} s", file=sys.stderr, flush=True)
    if not have_torch:
        rep.add("## Peer\n\nskipped: torch, transformers or peft is not installed.")
    rep.replace("## Ratios", _ratios(steps, peer))
    rep.add(f"Total {time.time() - t0:.0f} s.")
    return 1 if failures else 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument(
        "--out",
        default="",
        help="report path (default results/gpu.md; --cpu-smoke: the temp folder)",
    )
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all")
    ap.add_argument("--shapes", default="", help="comma-separated; default: all")
    ap.add_argument("--skip-numerics", action="store_true", help="steps and peer only")
    ap.add_argument(
        "--worker", choices=["numerics", "restore", "steps"], help=argparse.SUPPRESS
    )
    ap.add_argument("--role", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--npz", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=512, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        fn = {
            "numerics": worker_numerics,
            "restore": worker_restore,
            "steps": worker_steps,
        }[a.worker]
        print(json.dumps(fn(a)), flush=True)
        return
    sys.exit(orchestrate(a))


if __name__ == "__main__":
    main()
