"""Float32 products of many input rows (a prompt): 16 rows in a register's lanes.

From 16 input rows, `ggml_matvec.cc` rearranges ``x`` into tiles of 16 rows
(``FloatTiles``) and multiplies each weight, decoded once into float32, by 16 rows
with one fused multiply-add. Checked for every format against float64 products of
the dequantized matrix (``4e-6·|x| |Ŵ|ᵀ``, the kernel's contract), 45 weight rows
(groups of 4 and a remainder) and rows past ``n`` in the last tile; and each row's
result does not depend on the other rows of its tile, bit for bit (AVX-512 only:
elsewhere the 8-row path runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_int8_matvec import _cpu_has
from test_quant_matvec import raw_blocks

from entrenar import native, nn
from entrenar.nn import matvec as nn_matvec
from entrenar.quant import matvec
from entrenar.quant.ggml import from_ggml, quantize_ggml

KERNEL = native.reason("ggml_matvec")
FORMATS = ("q8_0", "q4_0", "q4_1", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16")


def _weight(kind: str, rows: int, cols: int):
    if kind.islower():
        rng = np.random.default_rng(1)
        return quantize_ggml(rng.standard_normal((rows, cols)).astype(np.float32), kind)
    return from_ggml(raw_blocks(kind, rows, cols), kind, (rows, cols))


def _product(w, x):
    with nn_matvec.activations("float32"):
        f = jax.jit(nn.linear)
        assert "matvec" in f.lower(x, w).as_text()
        return np.asarray(f(x, w), np.float64)


@pytest.mark.skipif(KERNEL is not None, reason=f"the kernel is off here: {KERNEL}")
@pytest.mark.parametrize("kind", FORMATS)
def test_row_tiles_keep_the_contract_and_rows_apart(kind):
    w = _weight(kind, 45, 512)
    x = np.random.default_rng(2).standard_normal((64, 512)).astype(np.float32)
    dense = np.asarray(matvec.dense(w, jnp.float32), np.float64)  # (45, 512)
    full = _product(w, jnp.asarray(x))  # (64, 45)
    scale = np.abs(x).astype(np.float64) @ np.abs(dense).T
    assert np.all(np.abs(full - x.astype(np.float64) @ dense.T) <= 4e-6 * scale)
    if not _cpu_has("avx512f"):
        return  # the 8-row path: a row's sums depend on its group of 8, 4, 2 or 1
    for n in (16, 33, 61):
        np.testing.assert_array_equal(_product(w, jnp.asarray(x[:n])), full[:n])
    np.testing.assert_array_equal(_product(w, jnp.asarray(x[3:40])), full[3:40])
