"""Headline fine-tuning benchmark: a LoRA / QLoRA step of SmolLM2-135M's shape.

One run measures, each in its own process (so each peak resident set is its own):

- entrenar LoRA (rank 8, alpha 16 on q_proj/v_proj, AdamW 1e-4, batch 4 x 128, labels
  = inputs), written with the public API: `LlamaConfig`, `lora.apply/split/combine`,
  `nn.losses.chunked_causal_lm_loss` on `Llama.features` (``--loss full``:
  `nn.causal_lm_loss` of `Llama.apply`'s logits),
  `optim.adamw`, one jitted step with donated buffers; in float32 and with
  ``LlamaConfig(matmul_dtype="bfloat16")`` (bfloat16 matmul inputs, float32
  accumulation, float32 everything else), and that with the frozen projections
  rounded to bfloat16 once (`nn.to_bfloat16_weights`, with the tied embedding's head
  as `nn.TiedEmbedding`: what the Trainer does; case
  ``entrenar_lora_bf16_frozen_bf16``) instead of at every step;
- entrenar QLoRA: every projection of the layers NF4 with double quantization
  (`quant.quantize_params`), the same adapters on top, bfloat16 matmuls (float32
  with ``--cases entrenar_qlora_f32``), and that with the head rounded once
  (``entrenar_qlora_bf16_frozen_bf16``);
- the peer, ``../shared/bench/peers/torch_llama_lora.py`` (transformers + PEFT +
  torch.optim.AdamW, same shape, rank, targets), in float32 and with ``--bf16``
  (``torch.autocast("cpu", bfloat16)``);
- the machine's matmul rate in float32 and in bfloat16-in/float32-out, at the
  model's MLP shape and at 2048^3, to express each step's achieved FLOP/s as a
  fraction of it (FLOPs counted: forward, plus the backward the adapters need: the
  input gradients of every matmul and of attention, and the adapters' own gradients;
  no weight gradients of frozen matrices; recomputation is not counted);
- the bfloat16 step's matmul floor (`worker_floor`): its matmuls timed alone at
  their own shapes and summed, and the fraction of the rate a step that did nothing
  else would reach.

Step times are medians over ``--steps`` timed steps after two warm-up steps (the
peer's protocol); entrenar's compile time (lower + compile) is reported apart. Peak
RSS is the child's ``ru_maxrss`` from ``os.wait4`` (set-up included: an entrenar
QLoRA run first builds float32 weights, then quantizes them); entrenar's runs also
report their RSS after set-up and XLA's own accounting of the step (arguments and
temporaries, `Compiled.memory_analysis`). Prints one JSON document.

    python benchmarks/finetune_step.py [--layers 30] [--steps 6] [--only entrenar]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEER = Path(__file__).resolve().parents[2] / "shared" / "bench" / "peers"
PEER_SCRIPT = PEER / "torch_llama_lora.py"

# (name, worker arguments); matmul dtype "none" is the float32 default.
ENTRENAR_CASES: list[tuple[str, list[str]]] = [
    ("entrenar_lora_f32", ["--variant", "lora", "--matmul-dtype", "none"]),
    ("entrenar_lora_bf16", ["--variant", "lora", "--matmul-dtype", "bfloat16"]),
    ("entrenar_qlora_bf16", ["--variant", "qlora", "--matmul-dtype", "bfloat16"]),
    # the frozen projections rounded to bfloat16 once (nn.to_bfloat16_weights)
    (
        "entrenar_lora_bf16_frozen_bf16",
        ["--variant", "lora", "--matmul-dtype", "bfloat16", "--frozen-bf16"],
    ),
    # what the Trainer runs for QLoRA: the tied embedding's head rounded once too
    (
        "entrenar_qlora_bf16_frozen_bf16",
        ["--variant", "qlora", "--matmul-dtype", "bfloat16", "--frozen-bf16"],
    ),
]
OPTIONAL_CASES: list[tuple[str, list[str]]] = [
    ("entrenar_qlora_f32", ["--variant", "qlora", "--matmul-dtype", "none"]),
]


# ---------------------------------------------------------------------- FLOPs
def step_flops(layers: int, batch: int, seq: int, rank: int) -> dict[str, float]:
    """Useful FLOPs of one LoRA step of SmolLM2-135M's shape with ``layers`` layers.

    A matmul ``(n, k) x (k, m)`` is ``2nkm``. Forward: the seven projections of each
    layer, attention's two products (``q kᵀ`` and ``p v``, full ``T x T``, as both
    implementations compute them), the adapters, the output head. Backward for
    adapter training: ``dx`` of every projection and of the head (one matmul each),
    attention's four products (``dq, dk, dv, dp``), the adapters' ``dx``, ``dA``,
    ``dB``. No gradient of a frozen weight is counted.
    """
    d, i, v, h, kv, hd = 576, 1536, 49152, 9, 3, 64
    n = batch * seq
    proj = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * i  # weights per layer
    attn = 2 * (2 * batch * h * seq * seq * hd)  # q kᵀ and p v
    adapters = rank * d + rank * h * hd + rank * d + rank * kv * hd  # q and v: A, B
    fwd = layers * (2 * n * proj + attn + 2 * n * adapters) + 2 * n * d * v
    bwd = layers * (2 * n * proj + 2 * attn + 3 * 2 * n * adapters) + 2 * n * d * v
    return {"forward": float(fwd), "backward": float(bwd), "total": float(fwd + bwd)}


# -------------------------------------------------------------------- workers
def _rss_self_mib(field: str) -> float:
    """``VmHWM:`` (peak) or ``VmRSS:`` (current) of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def _best_seconds(f: Any, args: tuple[Any, ...], reps: int) -> float:
    """Seconds per call of ``f(*args)``: the best of 5 rounds of ``reps`` calls."""
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            r = f(*args)
        r.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def worker_rate(dtype: str) -> dict[str, Any]:
    """GFLOP/s of ``jnp.dot`` at the model's MLP shape and at 2048^3."""
    import jax
    import jax.numpy as jnp

    out: dict[str, Any] = {}
    for name, (m, k, n) in {
        "mlp_512x576x1536": (512, 576, 1536),
        "square_2048": (2048, 2048, 2048),
    }.items():
        if dtype == "float32":
            a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
            f = jax.jit(lambda a, b: jnp.dot(a, b))
        else:
            a, b = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)
            f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        best = _best_seconds(f, (a, b), max(1, int(2e10 // (2 * m * k * n))))
        out[name] = round(2 * m * k * n / best / 1e9, 1)
    out["gflops"] = max(out.values())
    return out


def worker_floor(a: argparse.Namespace) -> dict[str, Any]:
    """Seconds the bfloat16 LoRA step's matmuls take alone: the step's floor.

    Each of the step's XLA matmuls (bfloat16 inputs, float32 output, in the layout
    the step uses) is timed in isolation and summed with its count: per layer the
    seven projections forward (``x Wᵀ``), their input gradients (``g W``) and, under
    a ``dots*`` remat policy, gate and up again (recomputed); the head a chunk at a
    time (logits ``x Wᵀ`` and ``dz W`` from the transposed head
    `nn.TiedEmbedding` keeps). Attention (a native kernel) and the rank-8 adapter
    products are not in it. A step can be no faster than this, so
    ``flops / floor / rate`` is the best fraction of the matmul rate it can reach.
    """
    import jax
    import jax.numpy as jnp

    d, i, v, h, kv, hd = 576, 1536, 49152, 9, 3, 64
    n = a.batch * a.seq
    tokens = a.batch * (a.seq - 1)
    chunks = -(-tokens // a.chunk)
    c = -(-tokens // chunks)  # balanced chunks, as chunked_causal_lm_loss makes them
    nt = (((1,), (1,)), ((), ()))  # a (m, k) . b (n, k)
    nn_ = (((1,), (0,)), ((), ()))  # a (m, k) . b (k, n)
    seen: dict[tuple[int, int, int, bool], float] = {}

    def secs(m: int, k: int, cols: int, transposed_b: bool) -> float:
        key = (m, k, cols, transposed_b)
        if key not in seen:
            x = jnp.ones((m, k), jnp.bfloat16)
            w = jnp.ones((cols, k) if transposed_b else (k, cols), jnp.bfloat16)
            dims = nt if transposed_b else nn_
            f = jax.jit(
                lambda x, w, dims=dims: jax.lax.dot_general(
                    x, w, dims, preferred_element_type=jnp.float32
                )
            )
            reps = max(3, int(5e9 // (2 * m * k * cols)))
            seen[key] = _best_seconds(f, (x, w), reps)
        return seen[key]

    proj = [
        (h * hd, d),
        (kv * hd, d),
        (kv * hd, d),
        (d, h * hd),
        (i, d),
        (i, d),
        (d, i),
    ]
    fwd = sum(secs(n, fan_in, out, True) for out, fan_in in proj)
    bwd = sum(secs(n, out, fan_in, False) for out, fan_in in proj)
    remat = 2 * secs(n, d, i, True) if a.remat_policy.startswith("dots") else 0.0
    head = chunks * (secs(c, d, v, False) + secs(c, v, d, True))
    parts = {
        "layers_forward": a.layers * fwd,
        "layers_input_gradients": a.layers * bwd,
        "layers_recomputed": a.layers * remat,
        "head": head,
    }
    return {
        "floor_s": round(sum(parts.values()), 4),
        "parts_s": {k: round(x, 4) for k, x in parts.items()},
    }


def worker_entrenar(a: argparse.Namespace) -> dict[str, Any]:
    """One entrenar LoRA/QLoRA configuration: compile time, step times, loss."""
    import functools

    import jax

    from entrenar import lora, nn, optim, quant
    from entrenar.nn import LlamaConfig, causal_lm_loss
    from entrenar.nn import losses as nn_losses

    md = None if a.matmul_dtype == "none" else a.matmul_dtype
    cfg = LlamaConfig.smollm2_135m(
        num_layers=a.layers,
        matmul_dtype=md,
        remat=a.remat,
        remat_policy=a.remat_policy or None,
    )
    params = cfg.init(jax.random.key(0))
    if a.variant == "qlora":
        params = quant.quantize_params(
            params,
            "nf4",
            double_quant=True,
            predicate=lambda name, x: ".layers." in name and "_proj" in name,
        )
    params = lora.apply(
        params,
        lora.LoRAConfig(rank=a.rank, alpha=2 * a.rank, targets=["q_proj", "v_proj"]),
        key=jax.random.key(1),
    )
    trainable, frozen = lora.split(params)
    del params  # the halves hold every array; the float32 frozen half can go below
    if a.frozen_bf16:
        frozen = nn.to_bfloat16_weights(  # rounded once, as the Trainer does
            frozen, tied_embedding="model.embed_tokens.weight"
        )
    tx = optim.adamw(1e-4)
    state = tx.init(trainable)
    tokens = jax.random.randint(jax.random.key(2), (a.batch, a.seq), 0, cfg.vocab_size)

    def loss_of(t: Any, frozen: Any, tokens: jax.Array) -> jax.Array:
        p = lora.combine(t, frozen)
        if a.loss == "chunked":
            return nn_losses.chunked_causal_lm_loss(
                cfg.features(p, tokens),
                cfg.output_weight(p),
                tokens,
                chunk=a.chunk,
                matmul_dtype=md,
            )
        return causal_lm_loss(cfg.apply(p, tokens), tokens)  # logits (B, T, V)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable: Any, state: Any, frozen: Any, tokens: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(loss_of)(trainable, frozen, tokens)
        updates, state = tx.update(grads, state, trainable)
        return optim.apply_updates(trainable, updates), state, loss

    rss_setup = _rss_self_mib("VmRSS:")  # parameters built (and quantized)
    t0 = time.perf_counter()
    compiled = step.lower(trainable, state, frozen, tokens).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    mib = 1 << 20
    times, losses = [], []
    for i in range(a.steps + 2):
        t0 = time.perf_counter()
        trainable, state, loss = compiled(trainable, state, frozen, tokens)
        loss.block_until_ready()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {
        "compile_s": round(compile_s, 2),
        "step_s_median": round(statistics.median(times), 4),
        "step_s_min": round(min(times), 4),
        "step_s_max": round(max(times), 4),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "peak_rss_self_mib": round(_rss_self_mib("VmHWM:"), 1),
        "rss_after_setup_mib": round(rss_setup, 1),
        "step_arguments_mib": round(mem.argument_size_in_bytes / mib, 1),
        "step_temporaries_mib": round(mem.temp_size_in_bytes / mib, 1),
    }


# ---------------------------------------------------------------- orchestrator
def run_child(cmd: list[str]) -> tuple[dict[str, Any], float]:
    """Run ``cmd``; its last stdout line as JSON and its peak RSS in MiB (wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=dict(os.environ))
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read()
        if proc.returncode != 0:
            raise SystemExit(f"{cmd} failed ({proc.returncode}):\n{err.read()[-3000:]}")
    return json.loads(text.strip().splitlines()[-1]), usage.ru_maxrss / 1024


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The CPU's bfloat16 matmul flags (AMX, AVX512-BF16), as the report lists them."""
    from entrenar import native

    flags = native.cpu_flags()
    return sorted(x for x in flags if x.startswith("amx") or x == "avx512_bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument(
        "--loss",
        choices=["full", "chunked"],
        default="chunked",
        help="full: causal_lm_loss of Llama.apply's logits; chunked: "
        "chunked_causal_lm_loss of Llama.features (default)",
    )
    ap.add_argument("--chunk", type=int, default=128, help="tokens per loss chunk")
    ap.add_argument("--remat", action="store_true", help="LlamaConfig(remat=True)")
    ap.add_argument("--remat-policy", default="", help="LlamaConfig(remat_policy=...)")
    ap.add_argument(
        "--only",
        choices=["all", "entrenar", "peer"],
        default="all",
        help="measure only entrenar's cases or only the peer's",
    )
    ap.add_argument(
        "--cases",
        default="",
        help="comma-separated entrenar cases (default: all but entrenar_qlora_f32)",
    )
    ap.add_argument(
        "--worker", choices=["rate", "floor", "entrenar"], help=argparse.SUPPRESS
    )
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="lora", help=argparse.SUPPRESS)
    ap.add_argument("--matmul-dtype", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--frozen-bf16", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.worker == "rate":
        print(json.dumps(worker_rate(a.dtype)))
        return
    if a.worker == "floor":
        print(json.dumps(worker_floor(a)))
        return
    if a.worker == "entrenar":
        print(json.dumps(worker_entrenar(a)))
        return

    me = [sys.executable, str(Path(__file__).resolve())]
    shape = [
        "--layers",
        str(a.layers),
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--steps",
        str(a.steps),
        "--rank",
        str(a.rank),
    ]
    common = [*shape, "--loss", a.loss, "--chunk", str(a.chunk)]
    if a.remat:
        common.append("--remat")
    if a.remat_policy:
        common += ["--remat-policy", a.remat_policy]
    flops = step_flops(a.layers, a.batch, a.seq, a.rank)
    result: dict[str, Any] = {
        "benchmark": "finetune_step",
        "cpu": cpu_model(),
        "cpu_bf16_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "shape": {
            "layers": a.layers,
            "batch": a.batch,
            "seq": a.seq,
            "rank": a.rank,
            "targets": ["q_proj", "v_proj"],
            "optimizer": "AdamW(1e-4)",
            "loss": a.loss,
            "chunk": a.chunk,
            "remat": a.remat,
            "remat_policy": a.remat_policy or None,
        },
        "flops_per_step": flops,
    }
    log = sys.stderr
    rates: dict[str, Any] = {}
    for dt in ("float32", "bfloat16"):
        rates[dt], _ = run_child([*me, "--worker", "rate", "--dtype", dt])
        print(f"matmul rate {dt}: {rates[dt]}", file=log, flush=True)
    result["matmul_rate_gflops"] = rates
    floor, _ = run_child([*me, "--worker", "floor", *common])
    bf16 = rates["bfloat16"]["gflops"]
    floor["best_fraction_of_bf16_rate"] = round(
        flops["total"] / floor["floor_s"] / 1e9 / bf16, 3
    )
    result["bf16_matmul_floor"] = floor
    print(f"bfloat16 matmul floor: {floor}", file=log, flush=True)
    runs: dict[str, Any] = {}
    wanted = {c for c in a.cases.split(",") if c}
    if a.only in ("all", "entrenar"):
        import jax

        result["jax"] = jax.__version__
        for name, args in ENTRENAR_CASES + OPTIONAL_CASES:
            if (wanted and name not in wanted) or (
                not wanted and (name, args) in OPTIONAL_CASES
            ):
                continue
            rec, rss = run_child([*me, "--worker", "entrenar", *common, *args])
            rec["peak_rss_mib"] = round(rss, 1)
            rec["dtype_rate"] = "bfloat16" if "bfloat16" in args else "float32"
            runs[name] = rec
            print(f"{name}: {rec}", file=log, flush=True)
    if a.only in ("all", "peer"):
        if not PEER_SCRIPT.exists():
            raise SystemExit(f"peer script not found: {PEER_SCRIPT}")
        for name, extra in (("peer_f32", []), ("peer_bf16", ["--bf16"])):
            rec, rss = run_child([sys.executable, str(PEER_SCRIPT), *shape, *extra])
            rec["peak_rss_mib"] = round(rss, 1)
            rec["dtype_rate"] = "bfloat16" if extra else "float32"
            runs[name] = rec
            print(f"{name}: {rec}", file=log, flush=True)
    for rec in runs.values():
        gflops = flops["total"] / rec["step_s_median"] / 1e9
        rec["achieved_gflops"] = round(gflops, 1)
        rec["fraction_of_matmul_rate"] = round(
            gflops / rates[rec.pop("dtype_rate")]["gflops"], 3
        )
    result["runs"] = runs
    peers = [runs[k]["step_s_median"] for k in ("peer_f32", "peer_bf16") if k in runs]
    if peers:
        best = min(peers)
        result["faster_peer_step_s"] = best
        result["ratio_vs_faster_peer"] = {
            k: round(v["step_s_median"] / best, 3)
            for k, v in runs.items()
            if k.startswith("entrenar")
        }
        if "peer_f32" in runs:
            result["peak_rss_vs_peer_f32"] = {
                k: round(v["peak_rss_mib"] / runs["peer_f32"]["peak_rss_mib"], 3)
                for k, v in runs.items()
                if k.startswith("entrenar")
            }
    for suffix in ("", "_frozen_bf16"):
        lora = runs.get(f"entrenar_lora_bf16{suffix}")
        qlora = runs.get(f"entrenar_qlora_bf16{suffix}")
        if lora and qlora:
            result[f"qlora_over_lora_bf16{suffix}"] = round(
                qlora["step_s_median"] / lora["step_s_median"], 3
            )
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
