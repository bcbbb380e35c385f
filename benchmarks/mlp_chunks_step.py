"""Step time A/B of the two memory options of big QLoRA steps, in one process.

The step of `finetune_step.py`'s Trainer-like QLoRA (every linear layer of the
layers NF4 with double quantization, LoRA rank 16 on all of them, bfloat16 matmuls,
frozen half rounded once by `nn.to_bfloat16_weights`, chunked loss, AdamW) at a
model shape with ``--layers`` layers, batch ``--batch`` x ``--seq``, compiled once
per variant:

- ``whole``: every layer's MLP over all tokens at once (`nn.layers.token_chunked`
  bound raised past the shape);
- ``chunked``: the default bound (`nn.layers.MLP_CHUNK_ELEMENTS`), or ``--bound``;
- ``no-head-copy``: the default bound, the tied head read from the table
  (``tied_head_copy=False``), for a tied shape.

With ``--remat-saved`` the variants are instead every layer recomputed
(``remat_policy="nothing_saveable"``): ``nothing-saveable`` (the default bound),
``bf16-saved`` (``remat_saved_dtype="bfloat16"``: the layer inputs kept as
bfloat16) and ``bf16-saved-half-bound`` (also ``mlp_chunk_elements`` half the
bound).

Timed steps alternate between the variants (``--rounds`` rounds, one step of
each), so a change in the machine's load touches all alike; prints the median
wall and CPU (user + sys) seconds of each, and the XLA temporaries of each step.

    python benchmarks/mlp_chunks_step.py [--shape smollm2|qwen2.5-0.5b]
        [--layers 4] [--batch 1] [--seq 2048] [--rounds 5] [--bound N]
        [--remat-saved]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SHAPES = {
    # SmolLM2-135M: tied, I 1536 (1 x 2048: 3.1M tokens x I, under the bound)
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_heads=9, num_kv_heads=3, tie_word_embeddings=True),
    # Qwen2.5-0.5B: tied, I 4864 (1 x 2048: 10.0M, two chunks by default)
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_heads=14, num_kv_heads=2, tie_word_embeddings=True),
}  # fmt: skip


def build(
    a: argparse.Namespace, bound: int, head_copy: bool, **fields: Any
) -> tuple[Any, ...]:
    """The compiled step and its arguments for one variant."""
    import jax

    from entrenar import lora, nn, optim
    from entrenar.nn import LlamaConfig
    from entrenar.nn import losses as nn_losses

    cfg = LlamaConfig(**SHAPES[a.shape], num_layers=a.layers, rope_theta=1e4,
                      matmul_dtype="bfloat16", **fields)  # fmt: skip
    params = lora.apply(
        cfg.init(jax.random.key(0)),
        lora.LoRAConfig(rank=16, alpha=32, targets="all-linear", quantize_base="nf4",
                        quantize_untargeted=True),
        key=jax.random.key(1), quantize="nf4",
    )  # fmt: skip
    trainable, frozen = lora.split(params)
    emb = frozen["model"]["embed_tokens"]  # bfloat16, as a bfloat16 model's
    emb["weight"] = emb["weight"].astype(jax.numpy.bfloat16)
    frozen = nn.to_bfloat16_weights(
        frozen, tied_embedding="model.embed_tokens.weight", tied_head_copy=head_copy
    )
    tx = optim.adamw(1e-4)
    state = tx.init(trainable)
    tokens = jax.random.randint(jax.random.key(2), (a.batch, a.seq), 0, cfg.vocab_size)

    def loss_of(t: Any, frozen: Any, tokens: jax.Array) -> jax.Array:
        p = lora.combine(t, frozen)
        return nn_losses.chunked_causal_lm_loss(
            cfg.features(p, tokens), cfg.output_weight(p), tokens,
            matmul_dtype="bfloat16",
        )  # fmt: skip

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable: Any, state: Any, frozen: Any, tokens: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(loss_of)(trainable, frozen, tokens)
        updates, state = tx.update(grads, state, trainable)
        return optim.apply_updates(trainable, updates), state, loss

    nn.layers.MLP_CHUNK_ELEMENTS = bound  # read while tracing
    compiled = step.lower(trainable, state, frozen, tokens).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return compiled, [trainable, state, frozen, tokens], temp


def main() -> None:
    from machine import cpu_name

    from entrenar import nn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bound", type=int, default=nn.layers.MLP_CHUNK_ELEMENTS)
    ap.add_argument("--remat-saved", action="store_true")
    a = ap.parse_args()
    variants: dict[str, tuple[int, bool, dict[str, Any]]]
    if a.remat_saved:
        remat = {"remat_policy": "nothing_saveable"}
        saved = {**remat, "remat_saved_dtype": "bfloat16"}
        variants = {
            "nothing-saveable": (a.bound, True, remat),
            "bf16-saved": (a.bound, True, saved),
            "bf16-saved-half-bound": (
                a.bound, True, {**saved, "mlp_chunk_elements": a.bound // 2}
            ),
        }  # fmt: skip
    else:
        variants = {"whole": (1 << 62, True, {}), "chunked": (a.bound, True, {})}
        if SHAPES[a.shape]["tie_word_embeddings"]:
            variants["no-head-copy"] = (a.bound, False, {})
    built = {k: build(a, b, h, **f) for k, (b, h, f) in variants.items()}
    wall: dict[str, list[float]] = {k: [] for k in built}
    cpu: dict[str, list[float]] = {k: [] for k in built}
    for r in range(a.rounds + 1):  # round 0: warm-up
        for k, (compiled, args, _) in built.items():
            t0, c0 = time.perf_counter(), time.process_time()
            out = compiled(*args)
            out[2].block_until_ready()
            args[0], args[1] = out[0], out[1]
            if r:
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    print(json.dumps({
        "cpu": cpu_name(), "load_average": os.getloadavg()[0], "shape": a.shape,
        "layers": a.layers, "tokens": f"{a.batch} x {a.seq}", "bound": a.bound,
        "intermediate": SHAPES[a.shape]["intermediate_size"],
        **{k: {"wall_s": round(statistics.median(wall[k]), 4),
               "cpu_s": round(statistics.median(cpu[k]), 4),
               "temporaries_mb": round(built[k][2] / 1e6, 1)} for k in built},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
