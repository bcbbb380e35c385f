"""Decoding products from 8-bit activations, and weights read in the layer stack.

`entrenar.nn.matvec.set_activations("int8")` rounds each 32-value block of ``x`` to
8 bits with its own scale (``e_b = max|x_b| / 127``, ``x̂ = e_b·round(x / e_b)``) and
multiplies Q8_0 / Q4_0 / Q4_1 blocks by integer dot products (kernels/int8_dot.h).
Stated contract, checked here against float64 products of the dequantizer's values:

- the product is ``x̂ Ŵᵀ`` to float32 rounding (``4e-6·|x̂| |Ŵ|ᵀ``);
- it is off from ``x Ŵᵀ`` by at most ``Σ_b (e_b / 2)·Σ_j |Ŵ_bj|`` (the rounding of
  ``x``, the only approximation).

Both hold for every build of the kernel: AVX-512 with VNNI (this machine's
``-march=native``), AVX-512 without VNNI (``vpmaddubsw``), AVX2 only (the integer
loops), and clang. Layer views (`layer_params`) read a stacked weight in place and
give the slice's product bit for bit; a compiled decoding step copies no weight.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import io, native, nn
from entrenar.errors import ConfigError
from entrenar.nn import LlamaConfig
from entrenar.nn import matvec as nn_matvec
from entrenar.quant import matvec
from entrenar.quant.ggml import from_ggml, quantize_ggml
from entrenar.quant.kquant import FORMATS

KERNEL = native.reason("ggml_matvec")
needs_kernel = pytest.mark.skipif(
    KERNEL is not None, reason=f"the kernel is off here: {KERNEL}"
)

REFERENCE = '''
import numpy as np


def rounded(x):
    """x̂ (float64) and e (n, k/32): x rounded per 32-block as the kernel does."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    e = (np.abs(b).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(e != 0, np.float32(1) / np.where(e != 0, e, 1), 0)
    q = np.rint(b * inv.astype(np.float32))  # ties to even, as nearbyint
    return (q * e.astype(np.float64)).reshape(x.shape), e[..., 0]


def errors(x, dense, y):
    """(error vs x̂ Ŵᵀ over the float32 allowance, error vs x Ŵᵀ over the bound)."""
    xh, e = rounded(x)
    w = np.abs(dense)
    scale = np.abs(xh) @ w.T
    near = np.abs(y - xh @ dense.T) / (4e-6 * scale + 1e-30)
    bound = np.repeat(e / 2, 32, axis=1) @ w.T + 4e-6 * scale
    far = np.abs(y - x.astype(np.float64) @ dense.T) / (bound + 1e-30)
    return float(near.max()), float(far.max())
'''
exec(REFERENCE)  # rounded, errors: also run inside the other builds' processes


def _product(w, x):
    with nn_matvec.activations("int8"):
        f = jax.jit(nn.linear)
        assert "entrenar_q_matvec" in f.lower(x, w).as_text()
        return np.asarray(f(x, w), np.float64)


@needs_kernel
@pytest.mark.parametrize("cols", [96, 576])  # 3 blocks (odd), 18 blocks
@pytest.mark.parametrize("n", [1, 3, 12, 61])
@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1"])
def test_int8_product_is_the_rounded_inputs_product(scheme, n, cols):
    rng = np.random.default_rng(n + cols)
    w = quantize_ggml(rng.standard_normal((40, cols)).astype(np.float32), scheme)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[0, :32] = 0.0  # a block of zeros: e = 0
    y = _product(w, jnp.asarray(x))
    dense = np.asarray(matvec.dense(w, jnp.float32), np.float64)
    near, far = errors(x, dense, y)  # noqa: F821 (defined by exec above)
    assert near <= 1.0 and far <= 1.0
    with nn_matvec.activations("float32"):  # the default: x as given
        y32 = np.asarray(jax.jit(nn.linear)(jnp.asarray(x), w), np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(dense).T
    assert np.all(np.abs(y32 - x @ dense.T) <= 4e-6 * scale + 1e-30)
    assert not np.array_equal(y, y32)  # the int8 path did round x


@needs_kernel
@pytest.mark.parametrize("cols", [96, 576])
@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1"])
def test_tiles_keep_the_contract_and_rows_apart(scheme, cols):
    """From 10 input rows, 16 rows in a register's lanes (int8_dot.h's Int8Tiles)."""
    rng = np.random.default_rng(cols)
    # 45 weight rows (groups of 8 and a remainder), rows past n in the last tile.
    # Each input row is computed alone in its lane, so (where the CPU has AVX-512
    # VNNI, and the native build uses tiles) its product does not depend on the
    # other rows, bit for bit; the contract holds on every CPU.
    w = quantize_ggml(rng.standard_normal((45, cols)).astype(np.float32), scheme)
    x = rng.standard_normal((64, cols)).astype(np.float32) * 3
    x[5, :32] = 0.0  # a block of zeros: e = 0
    dense = np.asarray(matvec.dense(w, jnp.float32), np.float64)
    full = _product(w, jnp.asarray(x))  # (64, 45)
    near, far = errors(x, dense, full)  # noqa: F821 (defined by exec above)
    assert near <= 1.0 and far <= 1.0
    if not (_cpu_has("avx512_vnni") and _cpu_has("avx512bw")):
        return  # Int8Dot: a row's sums depend on its tile of 8, 4, 2 or 1 rows
    for n in (10, 16, 33, 61):
        part = _product(w, jnp.asarray(x[:n]))
        np.testing.assert_array_equal(part, full[:n])
    shifted = _product(w, jnp.asarray(x[3:40]))  # other rows share the tiles
    np.testing.assert_array_equal(shifted, full[3:40])


def test_activations_setting_is_checked_and_restored():
    assert nn_matvec.current_activations() == "float32"
    with nn_matvec.activations("int8"):
        assert nn_matvec.current_activations() == "int8"
    assert nn_matvec.current_activations() == "float32"
    with pytest.raises(ConfigError, match="choose one of float32, int8"):
        nn_matvec.set_activations("int4")


def _stack(kind, layers=3, rows=48, cols=512):
    """A stacked ``(layers, rows, cols)`` weight of ``kind``."""
    rng = np.random.default_rng(7)
    if kind in FORMATS:  # K-quant bytes: random codes, small float16 scales
        fmt = FORMATS[kind]
        shape = (layers, rows, cols // fmt.block_size, fmt.type_size)
        raw = rng.integers(0, 256, shape, np.uint8)
        for at in {"Q4_K": (0, 2), "Q6_K": (208,)}[kind]:
            half = (rng.standard_normal(shape[:3]) * 2e-2).astype(np.float16)
            raw[..., at : at + 2] = half[..., None].view(np.uint8)
        return from_ggml(raw.reshape(layers, rows, -1), kind, (layers, rows, cols))
    w = rng.standard_normal((layers, rows, cols)).astype(np.float32)
    return quantize_ggml(w, kind)


@needs_kernel
@pytest.mark.parametrize("kind", ["q8_0", "q4_1", "Q4_K", "Q6_K"])
def test_layer_view_reads_the_stack_in_place(kind):
    """A view of layer i multiplies as the slice does, bit for bit, with no copy."""
    stack = _stack(kind)
    params = {"mlp": {"w": {"weight": stack}}}
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 512)), jnp.float32)

    def by_view(params, x, i):
        view = nn_matvec.layer_params(params, i)["mlp"]["w"]["weight"]
        assert isinstance(view, matvec.StackedLayer) and view.shape == (48, 512)
        return nn.linear(x, view)

    def by_slice(params, x, i):
        w = jax.tree_util.tree_map(lambda a: a[i], params["mlp"]["w"]["weight"])
        return nn.linear(x, w)

    for i in range(3):
        got = jax.jit(by_view)(params, x, jnp.int32(i))
        np.testing.assert_array_equal(got, jax.jit(by_slice)(params, x, i))
    text = jax.jit(by_view).lower(params, x, jnp.int32(1)).compile().as_text()
    assert "dynamic-slice" not in text  # the kernel takes the stack and the index
    many = jnp.ones((nn_matvec.FEW_ROWS + 1, 512), jnp.float32)  # the JAX path
    np.testing.assert_allclose(
        jax.jit(by_view)(params, many, jnp.int32(2)),
        jax.jit(by_slice)(params, many, 2),
        rtol=1e-5,
        atol=1e-4,
    )


@needs_kernel
def test_decode_step_copies_no_layer_weights():
    """The compiled decoding step of a stored-weight model slices no codes out."""
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=128,
    )  # fmt: skip

    def convert(path, leaf):
        if "_proj" in jax.tree_util.keystr(path) and leaf.ndim == 3:
            return quantize_ggml(leaf, "q4_1")  # (L, out, in)
        return leaf

    stored = jax.tree_util.tree_map_with_path(convert, cfg.init(jax.random.key(0)))
    cache = cfg.init_cache(1, 16)
    ids = jnp.asarray([[5]], jnp.int32)
    text = (
        jax.jit(lambda p, c: cfg.apply_cached(p, ids, c))
        .lower(stored, cache)
        .compile()
        .as_text()
    )
    layer_codes = {  # one layer's codes, u8[out,in/2]: what a scan's slice makes
        "u8[" + ",".join(map(str, w.codes.shape[1:])) + "]"
        for w in jax.tree_util.tree_leaves(stored, is_leaf=matvec.supported)
        if matvec.supported(w)
    }
    made = re.compile(r"= (u8\[[0-9,]+\])\S* (dynamic-slice|fusion|copy)\(")
    sliced = [
        ln
        for ln in text.splitlines()
        if (m := made.search(ln)) and m.group(1) in layer_codes
    ]
    assert len(layer_codes) == 4  # q, k/v, gate/up, down_proj
    assert not sliced, sliced[:3]


BUILD = """
    import json, subprocess
    import jax, jax.numpy as jnp
    import numpy as np
    from entrenar import native, nn
    from entrenar.native import toolchain
    from entrenar.nn import matvec as nn_matvec
    from entrenar.quant import matvec
    from entrenar.quant.ggml import quantize_ggml
    toolchain.build_flags = lambda *_: (*toolchain.BASE_FLAGS, *FLAGS)
    assert native.load("ggml_matvec"), native.reason("ggml_matvec")
    worst = [0.0, 0.0, 0.0]
    for scheme in ("q8_0", "q4_0", "q4_1"):
        for n, cols in ((1, 96), (5, 576), (9, 64)):
            rng = np.random.default_rng(n)
            w = rng.standard_normal((24, cols)).astype(np.float32)
            w = quantize_ggml(w, scheme)
            x = rng.standard_normal((n, cols)).astype(np.float32)
            dense = np.asarray(matvec.dense(w, jnp.float32), np.float64)
            with nn_matvec.activations("int8"):
                y = np.asarray(jax.jit(nn.linear)(jnp.asarray(x), w), np.float64)
            near, far = errors(x, dense, y)
            y32 = np.asarray(jax.jit(nn.linear)(jnp.asarray(x), w), np.float64)
            scale = np.abs(x).astype(np.float64) @ np.abs(dense).T
            f32 = float((np.abs(y32 - x @ dense.T) / (4e-6 * scale + 1e-30)).max())
            worst = [max(a, b) for a, b in zip(worst, (near, far, f32))]
    libs = sorted(toolchain.cache_dir().glob("ggml_matvec-*.so"))
    dis = subprocess.run(["objdump", "-d", *map(str, libs)], capture_output=True,
                         text=True, check=True).stdout
    print(json.dumps({"worst": worst, "zmm": "zmm" in dis,
                      "vnni": "vpdpbusd" in dis, "libs": len(libs)}))
"""

FLAGS_OF = {
    "avx2": ("-march=x86-64-v3",),
    "avx512-no-vnni": ("-march=skylake-avx512", "-mprefer-vector-width=512"),
    "native": ("-march=native", "-mprefer-vector-width=512"),
}


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return flag in f.read().split()
    except OSError:
        return False


@pytest.mark.skipif(native.find_compiler() is None, reason="no C++ compiler")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump only")
@pytest.mark.parametrize(
    "build,compiler",
    [("avx2", None), ("avx512-no-vnni", None), ("native", "clang++"),
     ("avx2", "clang++")],
)  # fmt: skip
def test_every_build_keeps_the_contract(build, compiler, tmp_path):
    if not _cpu_has("avx2") or (build != "avx2" and not _cpu_has("avx512bw")):
        pytest.skip(f"this CPU cannot run the {build} build")
    if compiler is not None and shutil.which(compiler) is None:
        pytest.skip(f"no {compiler}")
    code = REFERENCE + f"\nFLAGS = {FLAGS_OF[build]!r}\n" + textwrap.dedent(BUILD)
    env = {**os.environ, "ENTRENAR_CACHE_DIR": str(tmp_path / "cache")}
    if compiler is not None:
        env["CXX"] = compiler
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    near, far, f32 = got["worst"]
    assert got["libs"] == 1 and near <= 1.0 and far <= 1.0 and f32 <= 1.0, got
    assert got["zmm"] == (build != "avx2")  # the fallback really has no AVX-512
    if build == "avx512-no-vnni":
        assert not got["vnni"]


def test_from_gguf_keep_quantized_reads_the_tied_head_as_q8_0():
    """SmolLM2's Q8_0 ``token_embd`` is kept as stored: the head is its own node."""
    from entrenar.chat import ChatModel
    from entrenar.quant import QuantizedWeight

    chat = ChatModel.from_gguf(io.smollm2_path(), keep_quantized=True)
    head = chat.params["model"]["embed_tokens"]["weight"]
    assert isinstance(head, QuantizedWeight) and head.scheme == "q8_0"
    assert chat.model.output_weight(chat.params) is head  # no second copy
    assert matvec.supported(head)  # decoding multiplies the stored bytes
