"""One AdamW step on 1M / 10M / 100M float32 parameters: entrenar vs optax vs PyTorch.

Each step is jitted as one function with the parameters and the state donated (updated
in place), fed a fixed gradient. entrenar's step is `optim.apply_gradients` (AdamW's
one-pass ``apply``: the native kernel, entrenar/optim/fused.py); "chain" is the same
optimizer's ``update`` + ``apply_updates`` (XLA's loops), optax's is its ``update`` +
``apply_updates``. The peers run in the
same process: optax's ``adamw`` (the same jitted, donated step), interleaved with
entrenar repetition by repetition in a rotating order so that machine noise hits both
alike; then, as a separate block (torch's OpenMP threads spin after each op and would
slow XLA's threads if interleaved), ``torch.optim.AdamW(fused=True)`` and
``foreach=True`` when torch is installed.

An AdamW step must read θ, g, m, v and write θ, m, v: 28 bytes per float32 parameter;
the bandwidth column is ``28 · N / time``. Reported: median milliseconds per step and
ratios (below 1 means entrenar is faster).

    python benchmarks/optim.py                   # 1M, 10M, 100M
    python benchmarks/optim.py --sizes 1e6 1e7   # a subset
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import optim as eo

BYTES_PER_PARAM = 28
HYPER = {"lr": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "wd": 0.01}


def jax_stepper(tx, n: int, one_pass: bool = False):
    """A no-argument function doing one donated, jitted step of ``tx`` on n params.

    ``one_pass``: `entrenar.optim.apply_gradients` (``tx.apply`` where it exists);
    else ``tx.update`` + ``apply_updates``.
    """
    params = jnp.ones(n, jnp.float32)
    grads = jnp.full(n, 1e-3, jnp.float32)
    box = {"p": params, "s": tx.init(params)}

    def step(p, s, g):
        if one_pass:
            return eo.apply_gradients(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return eo.apply_updates(p, u), s

    fn = jax.jit(step, donate_argnums=(0, 1))

    def run() -> None:
        box["p"], box["s"] = fn(box["p"], box["s"], grads)
        box["p"].block_until_ready()

    return run


def torch_stepper(n: int, fused: bool):
    import torch

    p = torch.nn.Parameter(torch.ones(n))
    p.grad = torch.full((n,), 1e-3)
    h = HYPER
    opt = torch.optim.AdamW(
        [p],
        lr=h["lr"],
        betas=(h["b1"], h["b2"]),
        eps=h["eps"],
        weight_decay=h["wd"],
        fused=fused or None,
        foreach=None if fused else True,
    )
    return opt.step


def measure(steppers: dict, reps: int) -> dict:
    for run in steppers.values():  # compile / warm up
        run()
        run()
    times: dict = {k: [] for k in steppers}
    names = list(steppers)
    for rep in range(reps):
        # rotate the order so no one always runs right after the same peer
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            run = steppers[name]
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="*", type=float, default=[1e6, 1e7, 1e8])
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    try:
        import optax
    except ImportError:  # pragma: no cover - optax is a dev dependency
        raise SystemExit("needs optax: pip install -e '.[dev]'") from None
    have_torch = False
    if not args.no_torch:
        try:
            import torch

            have_torch = True
            torch_threads = torch.get_num_threads()
        except ImportError:
            pass
    h = HYPER
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"optax {optax.__version__}"
    )
    if have_torch:
        print(f"torch {torch.__version__}, {torch_threads} threads")
    header = (
        f"{'params':>7} | {'entrenar ms':>11} | {'GB/s':>5} | {'chain ms':>8} | "
        f"{'optax ms':>8} | {'ratio':>5} | {'torch fused':>11} | {'ratio':>5} | "
        f"{'torch foreach':>13}"
    )
    print(header)
    print("-" * len(header))
    for size in args.sizes:
        n = int(size)
        reps = max(3, min(50, int(3e8 / n)))
        tx = eo.adamw(h["lr"], h["b1"], h["b2"], h["eps"], h["wd"])
        steppers = {
            "entrenar": jax_stepper(tx, n, one_pass=True),
            "chain": jax_stepper(tx, n),
            "optax": jax_stepper(
                optax.adamw(
                    h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["wd"]
                ),
                n,
            ),
        }
        t = measure(steppers, reps)
        if have_torch:
            # Measured as a separate block: torch's OpenMP threads keep spinning for a
            # while after each op and would steal the cores from XLA's threads.
            del steppers
            gc.collect()
            steppers = {"torch_fused": torch_stepper(n, fused=True)}
            if n <= 10**7:  # foreach allocates temporaries: skip at 100M for memory
                steppers["torch_foreach"] = torch_stepper(n, fused=False)
            t.update(measure(steppers, reps))
            time.sleep(1.0)  # let the OpenMP threads go idle before the next size
        gbs = BYTES_PER_PARAM * n / (t["entrenar"] * 1e-3) / 1e9
        tf = t.get("torch_fused", float("nan"))
        tfe = t.get("torch_foreach", float("nan"))
        print(
            f"{n / 1e6:>6.0f}M | {t['entrenar']:>11.2f} | {gbs:>5.1f} | "
            f"{t['chain']:>8.2f} | {t['optax']:>8.2f} | "
            f"{t['entrenar'] / t['optax']:>5.2f} | {tf:>11.2f} | "
            f"{t['entrenar'] / tf:>5.2f} | {tfe:>13.2f}",
            flush=True,
        )
        del steppers
        gc.collect()


if __name__ == "__main__":
    main()
