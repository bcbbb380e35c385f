r"""Record bitsandbytes' ``AdamW8bit`` (block-wise 8-bit AdamW) on CPU tensors.

bitsandbytes 0.50.2 (torch CPU backend: ``optimizer_update_8bit_blockwise`` and
``optimizer_update_32bit`` of ``bitsandbytes/backends/cpu/ops.py``) runs
``bnb.optim.AdamW8bit(lr, betas, eps, weight_decay)`` for `STEPS` steps on four
float32 tensors: two above ``min_8bit_size`` (4096 values; one whose last block of
256 is short) and two below it (float32 state). The gradients are normal values
scaled per row by ``exp(2·N(0, 1))`` so the moments span many decades of the
dynamic map. Recorded (``tests/data/bnb_adam8bit_reference.npz``): bitsandbytes'
signed and unsigned dynamic maps (``create_dynamic_map``), the starting tensors,
each step's gradients, and after each step the tensors and the optimizer state
(``state1``/``state2`` codes and ``absmax1``/``absmax2`` per block for 8-bit
tensors, float32 ``state1``/``state2`` otherwise). tests/optim/test_optim_adam8bit.py
replays it without bitsandbytes. Run it with a Python that has bitsandbytes (a
venv over the project's, ``pip install bitsandbytes``)::

    /tmp/bnbvenv/bin/python tests/oracles/make_bnb_adam8bit_reference.py \
        --out tests/data
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SHAPES = {"w": (50, 100), "e": (20, 256), "s": (30, 50), "b": (7,)}
"""5000 values (20 blocks, the last of 136), 5120 (20 blocks), 1500 and 7 (float32
state: under min_8bit_size)."""

HYPER = {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
STEPS = 6


def record(out: Path) -> None:
    """Run AdamW8bit and write the ``.npz``."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    import torch

    rng = np.random.default_rng(0)
    start = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    params = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in
              start.items()}  # fmt: skip
    opt = bnb.optim.AdamW8bit(
        list(params.values()),
        lr=HYPER["lr"],
        betas=(HYPER["b1"], HYPER["b2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
    )
    arrays: dict[str, np.ndarray] = {
        "map_signed": F.create_dynamic_map(signed=True).numpy(),
        "map_unsigned": F.create_dynamic_map(signed=False).numpy(),
        **{f"start.{k}": v for k, v in start.items()},
    }
    for t in range(1, STEPS + 1):
        for k, p in params.items():
            g = rng.normal(size=p.shape).astype(np.float32)
            rows = g.reshape(p.shape[0], -1) if p.ndim > 1 else g[None]
            rows *= np.exp(2 * rng.normal(size=(rows.shape[0], 1))).astype(np.float32)
            p.grad = torch.from_numpy(g)
            arrays[f"grad{t}.{k}"] = g
        opt.step()
        for k, p in params.items():
            arrays[f"param{t}.{k}"] = p.detach().numpy().copy()
            for name, x in opt.state[p].items():
                if name in ("state1", "state2", "absmax1", "absmax2"):
                    arrays[f"{name}_{t}.{k}"] = x.numpy().copy()
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "bnb_adam8bit_reference.npz", **arrays)
    print(f"bitsandbytes {bnb.__version__}, torch {torch.__version__}: "
          f"{len(arrays)} arrays")  # fmt: skip


def main() -> None:
    """The command line: ``--out`` folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/data"))
    record(parser.parse_args().out)


if __name__ == "__main__":
    main()
