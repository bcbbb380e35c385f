"""One LoRA fine-tuning step of SmolLM2-135M's shape: entrenar vs PyTorch + PEFT.

The peer is ``../shared/bench/peers/torch_llama_lora.py`` (transformers'
LlamaForCausalLM, PEFT LoRA on q_proj/v_proj, torch.optim.AdamW), run in a subprocess
with the same shape. entrenar's step: `lora.apply` (rank 8, alpha 16, q_proj/v_proj),
gradients of the next-token loss with respect to the adapters only, AdamW, one jitted
function with donated buffers. Both start from random weights; the step time does not
depend on them.

    python benchmarks/lora_step.py [--layers 30] [--batch 4] [--seq 128] [--steps 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax

from entrenar import lora, optim
from entrenar.nn import LlamaConfig
from entrenar.nn.losses import causal_lm_loss

PEER = Path(__file__).resolve().parents[2] / "shared" / "bench" / "peers"


def entrenar_step_times(
    layers: int, batch: int, seq: int, steps: int, rank: int
) -> list[float]:
    cfg = dataclasses.replace(LlamaConfig.smollm2_135m(), num_layers=layers)
    params = cfg.init(jax.random.key(0))
    params = lora.apply(
        params,
        lora.LoRAConfig(rank=rank, alpha=2 * rank, targets=["q_proj", "v_proj"]),
        key=jax.random.key(1),
    )
    trainable, frozen = lora.split(params)
    tx = optim.adamw(1e-4)
    state = tx.init(trainable)
    tokens = jax.random.randint(jax.random.key(2), (batch, seq + 1), 0, cfg.vocab_size)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable, state, frozen, tokens):
        def loss_of(t):
            logits = cfg.apply(lora.combine(t, frozen), tokens)  # (B, T, V)
            return causal_lm_loss(logits, tokens)

        loss, grads = jax.value_and_grad(loss_of)(trainable)
        updates, state = tx.update(grads, state, trainable)
        return optim.apply_updates(trainable, updates), state, loss

    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        trainable, state, loss = step(trainable, state, frozen, tokens)
        loss.block_until_ready()
        if i >= 2:  # two warm-up steps (the first compiles), as the peer does
            times.append(time.perf_counter() - t0)
    return times


def peer_step_time(layers: int, batch: int, seq: int, steps: int, rank: int) -> dict:
    script = PEER / "torch_llama_lora.py"
    if not script.exists():
        raise SystemExit(f"peer script not found: {script}")
    cmd = [
        sys.executable,
        str(script),
        "--layers",
        str(layers),
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--steps",
        str(steps),
        "--rank",
        str(rank),
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=True, env=dict(os.environ)
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()
    shape = (a.layers, a.batch, a.seq, a.steps, a.rank)
    print(
        f"LoRA step, SmolLM2-135M shape with {a.layers} layers, batch {a.batch} x "
        f"{a.seq} tokens, rank {a.rank} on q_proj/v_proj, AdamW"
    )
    ours = statistics.median(entrenar_step_times(*shape))
    print(
        f"entrenar (jax {jax.__version__}): {ours * 1e3:.0f} ms/step, "
        f"{a.batch * a.seq / ours:.0f} tokens/s"
    )
    peer = peer_step_time(*shape)
    print(f"peer (PyTorch + PEFT): {json.dumps(peer)}")
    theirs = float(peer["step_s_median"])
    print(f"ratio entrenar / peer = {ours / theirs:.2f} (below 1: entrenar faster)")


if __name__ == "__main__":
    main()
