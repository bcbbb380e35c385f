"""The decoding kernel on several threads (kernels/row_pool.h): same bits as on one.

`ggml_matvec.cc` splits a product's output rows over as many threads as XLA's
intra-op pool has (the CPUs the process may use) and computes every row the same way
in any split, so ``y`` must not depend on the number of threads, bit for bit. Checked
against a process pinned to one CPU (its pool has one thread: no helper starts), for
every format and both activations; and with several products running at once
(XLA's concurrent thunks, Python threads), where one of them has the helpers and the
others run alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_matvec import raw_blocks

from entrenar import native, nn
from entrenar.nn import matvec as nn_matvec
from entrenar.quant.ggml import from_ggml, quantize_ggml

KERNEL = native.reason("ggml_matvec")
pytestmark = pytest.mark.skipif(
    KERNEL is not None, reason=f"the kernel is off here: {KERNEL}"
)
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
several = pytest.mark.skipif(
    CPUS < 2 or not os.path.isdir("/proc/self/task"), reason="two CPUs, Linux"
)
ACTIVATIONS = ("float32", "int8")


def cases() -> list[tuple[str, object, np.ndarray]]:
    """``(name, weight (1000, 512), x (n, 512))`` for every format the kernel reads.

    Large enough to be split (`ForRowRanges`: ranges of >= 2^15 multiply-adds and
    >= 16 rows); 1000 rows, so the ranges are of unequal length.
    """
    rng = np.random.default_rng(0)
    out = []
    for kind in ("q8_0", "q4_0", "q4_1", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16"):
        shape = (1000, 512)
        if kind.islower():
            w = quantize_ggml(rng.standard_normal(shape).astype(np.float32), kind)
        else:
            w = from_ggml(raw_blocks(kind, *shape), kind, shape)
        for n in (1, 5, 61):
            x = rng.standard_normal((n, 512)).astype(np.float32)
            out.append((f"{kind}-{n}", w, x))
    return out


def products() -> dict[str, np.ndarray]:
    """Every case's kernel product under both activations, by name."""
    ys = {}
    for name, w, x in cases():
        for act in ACTIVATIONS:
            with nn_matvec.activations(act):
                f = jax.jit(nn.linear)
                assert "matvec" in f.lower(jnp.asarray(x), w).as_text()
                ys[f"{name}-{act}"] = np.asarray(f(jnp.asarray(x), w))
    return ys


def helpers() -> int:
    """Threads of this process named ``entrenar-rows`` (row_pool.h's helpers)."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("entrenar-rows")


PINNED = """
import json, os, sys
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # before jax starts
sys.path.insert(0, sys.argv[2])
import numpy as np
from test_quant_matvec_threads import helpers, products
np.savez(sys.argv[1], **products())
print(json.dumps({"helpers": helpers()}))
"""


@several
def test_products_are_bit_identical_on_one_thread_and_several(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", PINNED, str(tmp_path / "one.npz"), here],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"helpers": 0}
    one = np.load(tmp_path / "one.npz")
    ys = products()
    assert sorted(ys) == sorted(one.files) and len(ys) == 8 * 3 * 2
    for name, y in ys.items():
        assert np.array_equal(y.view(np.uint32), one[name].view(np.uint32)), name
    assert helpers() == CPUS - 1  # the split really ran on several threads


@several
def test_concurrent_products_equal_lone_ones():
    """XLA's concurrent thunks and Python threads share one pool of helpers."""
    rng = np.random.default_rng(1)
    ws = [
        quantize_ggml(rng.standard_normal((768, 576)).astype(np.float32), s)
        for s in ("q8_0", "q4_1", "q4_0")
    ]
    ws.append(from_ggml(raw_blocks("Q6_K", 768, 512), "Q6_K", (768, 512)))
    xs = [jnp.asarray(rng.standard_normal((1, w.shape[1])), jnp.float32) for w in ws]
    errors: list[str] = []
    with nn_matvec.activations("int8"):
        f = jax.jit(nn.linear)
        lone = [np.asarray(f(x, w)) for x, w in zip(xs, ws)]
        together = jax.jit(lambda xs, ws: [nn.linear(x, w) for x, w in zip(xs, ws)])
        for _ in range(20):  # four independent custom calls in one program
            for got, want in zip(together(xs, ws), lone):
                assert np.array_equal(np.asarray(got), want)

        def hammer(i: int) -> None:
            j = i % len(ws)
            for _ in range(50):
                if not np.array_equal(np.asarray(f(xs[j], ws[j])), lone[j]):
                    errors.append(f"thread {i}")

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
