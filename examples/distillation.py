"""Knowledge distillation on real data: digits (MLPs) and text (SmolLM2 -> tiny Llama).

    python examples/distillation.py [--seeds 5] [--lm-steps 30] [--no-lm]

1. Digits (scikit-learn's 8x8 handwritten digits, 1797 images, 10 classes; 60/40
   train/test split). A teacher MLP 64-256-256-10 (dropout, weight decay) trains on
   the whole training split. A student MLP 64-64-10 (1/18 of the teacher's weights)
   then learns from a small labelled set of 150 training images, alone
   (cross-entropy) or distilled (α T² KL + (1 − α) CE, T = 4, α = 0.9): same
   steps, batches and initialisation for each seed. Test accuracy, mean ± std.
2. Text: SmolLM2-135M-Instruct (the real Q4_1 GGUF, dequantized, frozen) teaches a
   2-layer Llama of width 64 (its tokenizer; 3.3 M weights, mostly the tied
   embedding) on examples/data/short_stories.txt: the last four stories are held
   out. The teacher runs inside the same jitted step as the student. Held-out
   next-token cross-entropy with and without distillation (T = 1, α = 0.5).

Both runs go through `entrenar.train.Trainer`; the distillation runs use
``entrenar.distill.make_distill_loss_fn`` with the teacher frozen (``trainable``).
"""

import argparse
import os
import time

import jax
import numpy as np

from entrenar import distill, io, optim
from entrenar.data import load_fast_tokenizer
from entrenar.nn import MLP, LlamaConfig
from entrenar.nn.losses import causal_lm_loss
from entrenar.train import TrainConfig, Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "short_stories.txt")


# ----------------------------------------------------------------------- digits
def digits_split():
    """``(train, test)`` dicts of ``x`` (N, 64) float32 in [0, 1] and ``y`` int32."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=0.4, random_state=0, stratify=y
    )
    return {"x": xtr, "y": ytr}, {"x": xte, "y": yte}


def fit(loss_fn_or_model, params, data, *, epochs, lr, seed, trainable=None, wd=0.0):
    """Train with AdamW + cosine decay; returns the final whole params tree."""
    cfg = TrainConfig(
        epochs=epochs,
        batch_size=64,
        seed=seed,
        loss="cross_entropy",
        progress=False,
        log_every=10_000,
    )
    steps = epochs * (len(data["y"]) // cfg.batch_size)
    tx = optim.adamw(optim.cosine_decay_schedule(lr, steps), weight_decay=wd)
    trainer = Trainer(loss_fn_or_model, params, tx, cfg, trainable=trainable)
    return trainer.fit(data).params


def accuracy(model, params, data) -> float:
    pred = np.argmax(np.asarray(jax.jit(model.apply)(params, data["x"])), axis=-1)
    return float(np.mean(pred == data["y"]))


def digits(seeds: int, labelled: int = 150) -> tuple[list[float], list[float]]:
    train, test = digits_split()
    teacher = MLP((64, 256, 256, 10), dropout=0.3)
    t0 = time.perf_counter()
    tp = fit(
        teacher,
        teacher.init(jax.random.key(100)),
        train,
        epochs=150,
        lr=3e-3,
        seed=100,
        wd=1e-4,
    )
    print(
        f"digits: teacher 64-256-256-10 on {len(train['y'])} images: test accuracy "
        f"{accuracy(teacher, tp, test):.4f} ({time.perf_counter() - t0:.0f} s)"
    )

    small = {k: v[:labelled] for k, v in train.items()}
    student = MLP((64, 64, 10))
    loss_fn = distill.make_distill_loss_fn(
        student, teacher, tp, temperature=4.0, alpha=0.9
    )
    alone, distilled = [], []
    for seed in range(seeds):
        sp = student.init(jax.random.key(seed))
        p = fit(student, sp, small, epochs=200, lr=3e-3, seed=seed)
        alone.append(accuracy(student, p, test))
        params = loss_fn.init(sp, key=jax.random.key(seed))
        p = fit(
            loss_fn,
            params,
            small,
            epochs=200,
            lr=3e-3,
            seed=seed,
            trainable=loss_fn.trainable,
        )
        distilled.append(accuracy(student, p["student"], test))
        print(f"  seed {seed}: alone {alone[-1]:.4f}  distilled {distilled[-1]:.4f}")
    print(
        f"digits student 64-64-10 on {labelled} labelled images, {seeds} seeds: "
        f"alone {np.mean(alone):.4f} ± {np.std(alone):.4f}, "
        f"distilled {np.mean(distilled):.4f} ± {np.std(distilled):.4f}"
    )
    return alone, distilled


# ------------------------------------------------------------------------- text
STUDENT_LM = dict(
    hidden_size=64,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)


def text_rows(tokenizer, seq_len: int, held_out: int = 4):
    """Train / held-out rows of ``seq_len`` tokens from the stories (one per line)."""
    with open(TEXT, encoding="utf-8") as f:
        stories = [s for s in f.read().split("\n") if s.strip()]

    def rows(texts):
        ids = np.concatenate([tokenizer.encode(t + "\n") for t in texts])
        n = len(ids) // seq_len
        x = ids[: n * seq_len].reshape(n, seq_len).astype(np.int32)
        return {"input_ids": x, "labels": x}

    return rows(stories[:-held_out]), rows(stories[-held_out:])


def language_model(steps: int, seq_len: int, seeds: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    path = io.smollm2_path()
    teacher, tp, _ = io.load_llama_gguf(path)
    tok = load_fast_tokenizer(path)
    train, held = text_rows(tok, seq_len)
    student = LlamaConfig(vocab_size=teacher.vocab_size, **STUDENT_LM)
    n_tokens = train["input_ids"].size
    print(
        f"text: {n_tokens} training / {held['input_ids'].size} held-out tokens; "
        f"teacher SmolLM2-135M ({teacher.num_params() / 1e6:.0f} M weights), "
        f"student {student.num_params() / 1e6:.1f} M"
    )
    cfg = dict(max_steps=steps, batch_size=8, progress=False, log_every=10_000)
    loss_fn = distill.make_distill_loss_fn(
        student, teacher, tp, temperature=1.0, alpha=0.5
    )
    alone, distilled = [], []
    for seed in range(seeds):
        sp = student.init(jax.random.key(seed))
        tx = optim.adam(optim.cosine_decay_schedule(1e-2, steps))
        base = Trainer(student, sp, tx, TrainConfig(seed=seed, **cfg))
        base.fit(train)
        alone.append(base.evaluate(held)["eval_loss"])
        kd = Trainer(
            loss_fn,
            loss_fn.init(sp, key=jax.random.key(seed)),
            tx,
            TrainConfig(seed=seed, **cfg),
            trainable=loss_fn.trainable,
        )
        kd.fit(train)
        distilled.append(kd.evaluate(held)["eval_ce"])
        print(
            f"  seed {seed}: held-out CE alone {alone[-1]:.4f}  "
            f"distilled {distilled[-1]:.4f}"
        )
    ce = jax.jit(lambda p, x: causal_lm_loss(teacher.apply(p, x), x))
    print(f"  (the teacher's own held-out CE: {float(ce(tp, held['input_ids'])):.4f})")
    print(
        f"text student, {steps} steps of 8 x {seq_len} tokens, {seeds} seed(s): "
        f"held-out CE alone {np.mean(alone):.4f} ± {np.std(alone):.4f}, "
        f"distilled {np.mean(distilled):.4f} ± {np.std(distilled):.4f} "
        f"({time.perf_counter() - t0:.0f} s)"
    )
    return float(np.mean(alone)), float(np.mean(distilled))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--lm-steps", type=int, default=30)
    parser.add_argument("--lm-seq-len", type=int, default=64)
    parser.add_argument("--lm-seeds", type=int, default=1)
    parser.add_argument("--no-lm", action="store_true", help="skip the text case")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.seeds:
        digits(args.seeds)
    if not args.no_lm:
        language_model(args.lm_steps, args.lm_seq_len, args.lm_seeds)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
