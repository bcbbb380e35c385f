"""First training loop: an XOR MLP with the Tensor API.

A 2-8-1 MLP learns XOR (inputs in {0, 1} plus a little Gaussian noise, so the
validation set is not a copy of the training set) with everything a real loop has:
a train/validation split, shuffled mini-batches, Adam, a cosine learning-rate schedule
set each step, gradient clipping, and early stopping on the validation loss.

    python examples/first_training_loop.py
"""

from __future__ import annotations

import math

import jax
import numpy as np

from entrenar.autograd import (
    Tensor,
    backward,
    binary_cross_entropy_with_logits,
    no_grad,
    relu,
)
from entrenar.optim import Adam, CosineScheduler, clip_grad_norm

INPUT_DIM, HIDDEN_DIM, OUTPUT_DIM = 2, 8, 1
LEARNING_RATE, MIN_LR = 0.03, 0.001
BATCH_SIZE, N_EPOCHS, PATIENCE, VAL_RATIO = 100, 25, 5, 0.2
MAX_GRAD_NORM = 1.0


def generate_xor_data(n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Draw n noisy XOR samples: x (n, 2) float32, y (n, 1) float32 in {0, 1}."""
    bits = rng.integers(0, 2, size=(n, 2))
    y = (bits[:, 0] != bits[:, 1]).astype(np.float32)[:, None]  # (n, 1)
    x = bits.astype(np.float32) + rng.normal(0.0, 0.15, (n, 2)).astype(np.float32)
    return x, y


class MLP:
    """input -> hidden (ReLU) -> output logit; Xavier-initialized."""

    def __init__(self, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        s1 = math.sqrt(2.0 / (INPUT_DIM + HIDDEN_DIM))
        s2 = math.sqrt(2.0 / (HIDDEN_DIM + OUTPUT_DIM))
        w1 = Tensor.randn((INPUT_DIM, HIDDEN_DIM), key=k1).data * s1  # (in, hidden)
        w2 = Tensor.randn((HIDDEN_DIM, OUTPUT_DIM), key=k2).data * s2  # (hidden, out)
        self.w1 = Tensor(w1, requires_grad=True)
        self.b1 = Tensor.zeros(HIDDEN_DIM, requires_grad=True)
        self.w2 = Tensor(w2, requires_grad=True)
        self.b2 = Tensor.zeros(OUTPUT_DIM, requires_grad=True)

    def __call__(self, x: Tensor) -> Tensor:
        h = relu(x @ self.w1 + self.b1)  # (B, hidden)
        return h @ self.w2 + self.b2  # (B, 1) logits

    def parameters(self) -> list[Tensor]:
        return [self.w1, self.b1, self.w2, self.b2]


def batches(x: np.ndarray, y: np.ndarray, size: int, rng=None):
    order = rng.permutation(len(x)) if rng is not None else np.arange(len(x))
    for i in range(0, len(x), size):
        idx = order[i : i + size]
        yield Tensor(x[idx]), Tensor(y[idx])


def evaluate(model: MLP, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Mean loss and accuracy over (x, y), without recording a tape."""
    with no_grad():
        logits = model(Tensor(x))
        loss = binary_cross_entropy_with_logits(logits, Tensor(y)).item()
    acc = float(np.mean((logits.numpy() > 0) == (y > 0.5)))
    return loss, acc


def main() -> None:
    print("=== entrenar training example: XOR ===\n")
    rng = np.random.default_rng(0)
    x, y = generate_xor_data(1000, rng)
    n_val = int(len(x) * VAL_RATIO)
    x_train, y_train, x_val, y_val = x[n_val:], y[n_val:], x[:n_val], y[:n_val]
    print(f"train samples: {len(x_train)}, validation samples: {len(x_val)}\n")

    model = MLP(key=jax.random.key(0))
    params = model.parameters()
    optimizer = Adam(LEARNING_RATE)
    steps_per_epoch = math.ceil(len(x_train) / BATCH_SIZE)
    scheduler = CosineScheduler(LEARNING_RATE, MIN_LR, N_EPOCHS * steps_per_epoch)

    best_val, patience, step = math.inf, 0, 0
    for epoch in range(N_EPOCHS):
        # 1. train on shuffled mini-batches
        train_loss = 0.0
        for xb, yb in batches(x_train, y_train, BATCH_SIZE, rng):
            optimizer.set_lr(scheduler.get_lr(step))
            loss = binary_cross_entropy_with_logits(model(xb), yb)
            train_loss += loss.item()
            backward(loss)
            clip_grad_norm(params, MAX_GRAD_NORM)
            optimizer.step(params)
            optimizer.zero_grad(params)
            step += 1
        train_loss /= steps_per_epoch
        # 2. validate
        val_loss, val_acc = evaluate(model, x_val, y_val)
        # 3. early stopping on the validation loss
        if val_loss < best_val:
            best_val, patience, mark = val_loss, 0, "* best"
        else:
            patience += 1
            mark = f"  (patience {patience}/{PATIENCE})"
        print(
            f"epoch {epoch:3d}: train_loss={train_loss:.4f} val_loss={val_loss:.4f} "
            f"val_acc={val_acc:.1%} lr={optimizer.lr:.4f} {mark}"
        )
        if patience >= PATIENCE:
            print("\nearly stopping")
            break

    _, train_acc = evaluate(model, x_train, y_train)
    val_loss, val_acc = evaluate(model, x_val, y_val)
    print("\n=== training complete ===")
    print(f"best validation loss: {best_val:.4f}")
    print(f"final accuracy: train {train_acc:.1%}, validation {val_acc:.1%}")


if __name__ == "__main__":
    main()
