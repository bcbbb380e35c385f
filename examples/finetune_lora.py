"""Fine-tune a small Llama with LoRA, then merge, save and reload the adapter.

    python examples/finetune_lora.py [--steps 60] [--out /tmp/entrenar_lora_adapter]

1. build a small Llama (random weights; any tree of the same layout works, e.g. one
   read from a GGUF file) and adapt q_proj / v_proj with rank-8 LoRA;
2. split the params into trainable adapters and frozen weights and train only the
   adapters (gradients are never formed for frozen weights);
3. check the merged model gives the same logits, save the adapter in PEFT's layout
   (loadable with ``peft.PeftModel.from_pretrained``) and load it back.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import lora, optim
from entrenar.nn import LlamaConfig
from entrenar.nn.losses import causal_lm_loss

MODEL = LlamaConfig(
    vocab_size=64,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=64,
)


def make_batch(key: jax.Array, batch: int = 16, length: int = 33) -> jax.Array:
    """Token sequences that count up modulo V from random starts (B, T)."""
    starts = jax.random.randint(key, (batch, 1), 0, MODEL.vocab_size)
    return (starts + jnp.arange(length)) % MODEL.vocab_size


def loss_fn(params, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy."""
    return causal_lm_loss(MODEL.apply(params, tokens), tokens)  # logits (B, T, V)


def train(params, steps: int, *, key: jax.Array, lr: float = 1e-2):
    """Adam on the adapters only. Returns (params, first loss, last loss)."""
    trainable, frozen = lora.split(params)
    tx = optim.adam(lr)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable, state, frozen, tokens):
        def loss_of(t):
            return loss_fn(lora.combine(t, frozen), tokens)

        loss, grads = jax.value_and_grad(loss_of)(trainable)
        updates, state = tx.update(grads, state, trainable)
        return optim.apply_updates(trainable, updates), state, loss

    state, losses = tx.init(trainable), []
    for i in range(steps):
        tokens = make_batch(jax.random.fold_in(key, i))
        trainable, state, loss = step(trainable, state, frozen, tokens)
        losses.append(float(loss))
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {losses[-1]:.4f}")
    return lora.combine(trainable, frozen), losses[0], losses[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="/tmp/entrenar_lora_adapter")
    args = parser.parse_args()

    root = jax.random.key(0)
    base = MODEL.init(jax.random.fold_in(root, 0))
    config = lora.LoRAConfig(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    params = lora.apply(base, config, key=jax.random.fold_in(root, 1))
    print(lora.trainable_report(params))

    t0 = time.perf_counter()
    params, first, last = train(params, args.steps, key=jax.random.fold_in(root, 2))
    print(f"loss {first:.4f} -> {last:.4f} in {time.perf_counter() - t0:.1f} s")

    tokens = make_batch(jax.random.fold_in(root, 3))
    merged = lora.fold(params)
    diff = jnp.max(jnp.abs(MODEL.apply(merged, tokens) - MODEL.apply(params, tokens)))
    print(f"merged vs adapted logits: max |diff| = {float(diff):.2e}")

    lora.save_adapter(params, args.out, base_model_name_or_path="entrenar-tiny-llama")
    reloaded = lora.load_adapter(args.out, base)
    same = np.array_equal(
        np.asarray(MODEL.apply(reloaded, tokens)),
        np.asarray(MODEL.apply(params, tokens)),
    )
    print(
        f"adapter saved to {args.out} (PEFT layout); reloaded logits identical: {same}"
    )


if __name__ == "__main__":
    main()
