"""The native NF4 quantizer (entrenar/kernels/nf4_quantize.cc) against the JAX path.

Two entries run the same C++: the custom call `entrenar.quant.quantize` emits and the
plain C call `quantize_nf4_host` makes on numpy buffers (what a load uses). They give
the same bits, on any number of threads. Against the pure-JAX twin (`_nf4_blocks`)
the kernel agrees to float32 rounding: without double quantization bit for bit; with
it DQ's mean is a float64 sum rounded once (checked against numpy's float64 mean to
half an ulp), so the DQ scales may move by an ulp and a code may differ only where
its value sits on a decision threshold.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar import native, quant
from entrenar.errors import QuantizationError, ShapeError
from entrenar.quant import nf4
from entrenar.quant.nf4 import _MIDPOINTS, double_dequantize, quantize_nf4_host
from entrenar.quant.weight import unpack_nibbles
from entrenar.runs.models import BaseQuantize

needs_kernel = pytest.mark.skipif(
    native.reason("nf4_quantize") is not None,
    reason=f"the native kernel is off here: {native.reason('nf4_quantize')}",
)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _leaves(node) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(node)]


def assert_same_node(a, b) -> None:
    """Same structure, static fields, dtypes, shapes and bits."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def weights(rng, shape, dtype, zero_blocks: bool = True) -> np.ndarray:
    """Normal weights of mixed magnitude per row, some blocks all zero."""
    w = rng.standard_normal(shape, np.float32)
    w *= np.exp(rng.uniform(-6, 2, (*shape[:-1], 1))).astype(np.float32)
    if zero_blocks and w.size >= 64:
        w.reshape(-1, 32)[rng.integers(0, w.size // 32, 2)] = 0.0  # whole blocks
    return w.astype(dtype)


def jax_path(w, double_quant, block_size=64):
    with native.policy("jax"):
        return quant.quantize(jnp.asarray(w), "nf4", double_quant=double_quant,
                              block_size=block_size)  # fmt: skip


SHAPES = st.sampled_from(
    [(64,), (1, 64), (3, 128), (40, 320), (2, 7, 192), (2, 2, 5, 64), (300, 64)]
)


@needs_kernel
@given(shape=SHAPES, seed=st.integers(0, 2**16), bf16=st.booleans(),
       double_quant=st.booleans(), block=st.sampled_from([64, 32]))  # fmt: skip
def test_kernel_equals_the_jax_path_to_float32_rounding(
    shape, seed, bf16, double_quant, block
):
    rng = np.random.default_rng(seed)
    w = weights(rng, shape, BF16 if bf16 else np.float32)
    got = quant.quantize(jnp.asarray(w), "nf4", double_quant=double_quant,
                         block_size=block)  # fmt: skip
    want = jax_path(w, double_quant, block)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    if not double_quant:  # every step exact in float32: the same bits
        assert_same_node(got, want)
        return
    x = np.asarray(w, np.float32).reshape(*shape[:-1], -1, block)  # (*lead, nb, B)
    s = np.abs(x).max(-1)  # exact block absmax (*lead, nb)
    lead2 = s.shape[:-2] if s.ndim >= 2 else ()
    mean64 = s.reshape(*lead2, -1).astype(np.float64).mean(-1)  # (*stack,)
    mean = np.asarray(got.scale_offset)
    ulp = np.spacing(np.abs(mean).astype(np.float32))
    assert np.all(np.abs(mean - mean64) <= 0.5 * ulp + 1e-12 * np.abs(mean64))
    s_got = np.asarray(double_dequantize(got.scales, got.scale_scales, mean))
    s_want = np.asarray(nf4.block_scales(want))
    np.testing.assert_allclose(s_got, s_want, rtol=2e-6, atol=2e-6 * s.max())
    # codes: equal except where x / s sits on a threshold under one of the scales
    y = x / np.where(s_want == 0, 1, s_want)[..., None]
    near = np.abs(y[..., None] - _MIDPOINTS) <= 1e-5 * (1 + np.abs(y[..., None]))
    c_got = np.asarray(unpack_nibbles(got.codes, block))
    c_want = np.asarray(unpack_nibbles(want.codes, block))
    assert np.all((c_got == c_want) | near.any(-1))


@needs_kernel
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("shape", [(3, 1152, 1536), (2, 4, 64, 128), (192, 576)])
def test_the_host_call_and_the_custom_call_give_the_same_bits(shape, double_quant):
    """Same C++, same node, however many threads; a bf16 array as its float32 cast.

    (The host call starts threads from 4M values: the first shape's 5.3M.)
    """
    rng = np.random.default_rng(len(shape))
    w16 = weights(rng, shape, BF16)
    w32 = w16.astype(np.float32)
    want = quant.quantize(jnp.asarray(w32), "nf4", double_quant=double_quant)
    for w, threads in ((w32, 1), (w32, 2), (w16, 3)):
        got, finite = quantize_nf4_host(w, double_quant=double_quant,
                                        dtype=np.float32, threads=threads)  # fmt: skip
        assert finite
        assert_same_node(got, want)
    jitted = jax.jit(lambda w: quant.quantize(w, "nf4", double_quant=double_quant))
    assert_same_node(jitted(jnp.asarray(w32)), want)


@needs_kernel
def test_the_host_call_writes_into_given_arrays():
    rng = np.random.default_rng(5)
    w = weights(rng, (4, 96, 256), np.float32)
    whole, _ = quantize_nf4_host(w, double_quant=True)
    out = jax.tree_util.tree_map(np.zeros_like, whole)
    for i in range(4):
        view = jax.tree_util.tree_map(lambda a, i=i: a[i : i + 1], out)
        got, _ = quantize_nf4_host(w[i : i + 1], double_quant=True, out=view)
        assert all(np.shares_memory(g, v) for g, v in zip(_leaves(got), _leaves(view)))
    assert_same_node(out, whole)
    first = jax.tree_util.tree_map(lambda a: a[:1], out)
    bad = dataclasses.replace(first, codes=first.codes[:, :-1])
    with pytest.raises(ShapeError, match=r"out\.codes"):
        quantize_nf4_host(w[:1], double_quant=True, out=bad)


@needs_kernel
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_flagged_and_refused(bad, double_quant):
    w = np.full((3, 64, 128), 0.5, np.float32)
    w[1, 17, 100] = bad
    _, finite = quantize_nf4_host(w, double_quant=double_quant)
    assert not finite
    _, ok = quantize_nf4_host(w[:1], double_quant=double_quant)
    assert ok
    with pytest.raises(QuantizationError, match=r"index \(1, 17, 100\)"):
        quant.quantize(jnp.asarray(w), "nf4", double_quant=double_quant)
    host = BaseQuantize("nf4").on_host(np.float32, np.float32)
    with pytest.raises(QuantizationError, match=r"index \(1, 17, 100\)"):
        host(w, None)
    _, finite = jax.jit(
        lambda w: nf4.quantize_nf4_checked(w, double_quant=double_quant)
    )(jnp.asarray(w))
    assert not bool(finite)


@needs_kernel
def test_the_gradient_is_the_jax_paths():
    """A custom call has no derivative: the JAX path's tangents stand in."""
    w = jnp.asarray(weights(np.random.default_rng(1), (64, 128), np.float32))

    def f(w):
        q = quant.quantize(w, "nf4", double_quant=True)
        return q.scale_offset + q.scale_scales.sum()

    g = jax.grad(f)(w)
    with native.policy("jax"):
        g_jax = jax.grad(f)(w)
    np.testing.assert_array_equal(g, g_jax)
    assert float(jnp.abs(g).sum()) > 0


def test_policy_jax_runs_no_kernel_and_no_host_call():
    w = np.ones((4, 64), np.float32)
    with native.policy("jax"):
        assert quantize_nf4_host(w) is None
        assert BaseQuantize("nf4").on_host(np.float32, np.float32) is None
        text = jax.jit(lambda w: quant.quantize(w, "nf4")).lower(w).as_text()
        assert "entrenar_" not in text
    assert BaseQuantize("int4").on_host(np.float32, np.float32) is None
    assert quantize_nf4_host(w.astype(np.float16)) is None  # a dtype it does not take


@needs_kernel
def test_a_host_form_asked_before_the_policy_changed_still_writes_its_node():
    """The JAX path takes over, into the arrays given, when the kernel went off."""
    rng = np.random.default_rng(3)
    w = weights(rng, (1, 64, 128), np.float32)
    host = BaseQuantize("nf4").on_host(np.float32, np.float32)
    want = jax_path(w, True)
    into = jax.tree_util.tree_map(np.zeros_like, want)
    with native.policy("jax"):
        got = host(w, into)
    assert got is into
    assert_same_node(into, jax.tree_util.tree_map(np.asarray, want))


SCALAR_BUILD = """
    import platform
    import jax.numpy as jnp
    import numpy as np
    from entrenar import native, quant
    from entrenar.native import toolchain
    from entrenar.quant.nf4 import quantize_nf4_host

    # a CPU without AVX-512: the scalar loops of the kernel, forced here
    flags = "-march=x86-64-v3" if platform.machine() == "x86_64" else "-O2"
    toolchain.build_flags = lambda *_: (*toolchain.BASE_FLAGS, flags)
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((3, 40, 192)) * 0.02).astype(np.float32)
    got = quant.quantize(jnp.asarray(w), "nf4")
    with native.policy("jax"):
        want = quant.quantize(jnp.asarray(w), "nf4")
    host, _ = quantize_nf4_host(w)
    for a, b, c in zip(got.codes, want.codes, host.codes):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    assert np.array_equal(got.scales, want.scales)
    print(native.reason("nf4_quantize"))
"""


@needs_kernel
def test_the_scalar_build_gives_the_same_codes(tmp_path):
    """Without AVX-512 the codes come from the scalar loop: the same bits."""
    env = {**os.environ, "ENTRENAR_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCALAR_BUILD)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["None"]
