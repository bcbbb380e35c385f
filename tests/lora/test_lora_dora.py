"""DoRA (Liu et al. 2024, arXiv:2402.09353) against PEFT 0.21 on a tiny Llama.

PEFT's ``use_dora=True`` computes ``y = (m / n) ⊙ (x Wᵀ + s (x Aᵀ) Bᵀ)`` with
``n = ‖W + s B A‖`` per output row detached from the gradient (the paper's section
4.3); every test compares entrenar with PEFT + transformers on the same weights, or
with that formula written out in numpy.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peft_cases import CFG

from entrenar import lora, quant
from entrenar.errors import CompatibilityError, UnsupportedError
from entrenar.lora import LoRAConfig, LoRAWeight
from entrenar.lora.names import hf_modules, named_weight_leaves
from entrenar.lora.weight import dora_norm
from entrenar.nn import LlamaConfig, linear, to_hf_names
from entrenar.nn.layers import dropout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
st_numpy = pytest.importorskip("safetensors.numpy")

TOKENS = np.array([[1, 5, 9, 2, 33, 7, 60, 3], [4, 4, 8, 15, 16, 23, 42, 0]])
QV = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def base():
    return CFG.init(jax.random.key(0))


def hf_model(params):
    """A LlamaForCausalLM holding exactly ``params``."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**CFG.to_hf_config())
    )
    state = {k: torch.from_numpy(np.array(v)) for k, v in to_hf_names(params).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model.eval()


def torch_logits(model):
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


def our_logits(params, cfg=CFG):
    return np.asarray(cfg.apply(params, jnp.asarray(TOKENS)))


def is_adapter(x):
    return isinstance(x, LoRAWeight)


def trained(params, cfg, seed=3, quantize=None):
    """``lora.apply`` with DoRA, then random B and magnitudes m ≠ ‖W‖ (as trained)."""
    lp = lora.apply(params, cfg, key=jax.random.key(seed), quantize=quantize)
    rng = np.random.default_rng(seed)

    def fill(x):
        if not is_adapter(x):
            return x
        b = (rng.normal(size=x.b.shape) * 0.05).astype(np.float32)
        m = np.asarray(x.magnitude) * rng.uniform(0.6, 1.4, size=x.magnitude.shape)
        return x.replace(b=jnp.asarray(b), magnitude=jnp.asarray(m, jnp.float32))

    return jax.tree_util.tree_map(fill, lp, is_leaf=is_adapter)


def per_module(tree):
    """``{PEFT module name: {"A", "B", "magnitude": array}}`` of a tree of nodes."""
    out = {}
    for name, x in named_weight_leaves(tree):
        if not is_adapter(x):
            continue
        stacked = np.ndim(x.a) == 3
        for i, m in enumerate(hf_modules(name, x.shape)):
            parts = {"A": x.a, "B": x.b, "magnitude": x.magnitude}
            out[m] = {k: np.asarray(v[i] if stacked else v) for k, v in parts.items()}
    return out


def peft_grads(model):
    """The same layout from a PEFT model's ``.grad`` of its adapter parameters."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        mod, _, rest = name.removeprefix("base_model.model.").partition(".lora_")
        part = {"A": "A", "B": "B", "m": "magnitude"}[rest[0]]
        out.setdefault(mod, {})[part] = p.grad.numpy()
    return out


def close(ours, theirs, rtol=1e-5):
    """Equal to ``rtol`` of the largest magnitude of the reference."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    scale = max(np.abs(theirs).max(), 1e-30)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("targets", [QV, ("all-linear",)])
def test_forward_and_gradients_equal_peft(base, tmp_path, targets):
    """Logits and the gradients of A, B and m of a loss equal PEFT's (float32)."""
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=targets, use_dora=True)
    lp = trained(base, cfg)
    lora.save_adapter(lp, tmp_path)
    model = peft.PeftModel.from_pretrained(
        hf_model(base), str(tmp_path), is_trainable=True
    ).eval()  # eval: dropout off (it is 0 anyway)
    tokens = torch.from_numpy(TOKENS)
    logits_t = model(tokens).logits
    weights = np.random.default_rng(9).normal(size=logits_t.shape).astype(np.float32)
    (logits_t * torch.from_numpy(weights)).sum().backward()

    trainable, frozen = lora.split(lp)

    def loss(t):
        logits = CFG.apply(lora.combine(t, frozen), jnp.asarray(TOKENS))
        return jnp.sum(logits * weights), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
    assert np.abs(np.asarray(logits) - our_logits(base)).max() > 1e-2  # DoRA matters
    close(logits, logits_t.detach().numpy())
    ours, theirs = per_module(grads), peft_grads(model)
    assert sorted(ours) == sorted(theirs) and len(ours) >= 4
    for mod in theirs:
        for part in ("A", "B", "magnitude"):
            close(ours[mod][part], theirs[mod][part])


def test_adapter_saved_by_peft_loads_here_and_back(base, tmp_path):
    """A PEFT DoRA file gives PEFT's logits here; saved again, the same file."""
    pcfg = peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=["k_proj", "o_proj", "down_proj"],
        use_dora=True, init_lora_weights=False,
    )  # fmt: skip
    model = peft.get_peft_model(hf_model(base), pcfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(torch.rand(p.shape, generator=gen) + 0.5)
    expected = torch_logits(model)
    model.save_pretrained(str(tmp_path / "peft"))
    loaded = lora.load_adapter(tmp_path / "peft", base)
    node = loaded["model"]["layers"]["mlp"]["down_proj"]["weight"]
    assert node.dora and node.magnitude.shape == (2, 32)
    close(our_logits(loaded), expected)
    lora.save_adapter(loaded, tmp_path / "back")
    theirs = st_numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    ours = st_numpy.load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector" in ours
    for name, x in ours.items():
        assert x.dtype == theirs[name].dtype and x.shape == theirs[name].shape, name
        np.testing.assert_array_equal(x, theirs[name])
    cfg = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert cfg["use_dora"] is True
    again = peft.PeftModel.from_pretrained(hf_model(base), str(tmp_path / "back"))
    close(torch_logits(again.eval()), expected)


def test_new_adapter_keys_and_trainable_count_match_peft(base, tmp_path):
    """Fresh DoRA (B = 0, m = ‖W‖): base logits, PEFT's file layout and counts."""
    cfg = LoRAConfig(rank=2, alpha=4.0, targets=QV, use_dora=True)
    lp = lora.apply(base, cfg, key=jax.random.key(0))
    close(our_logits(lp), our_logits(base), rtol=1e-6)  # m/n = 1 to rounding
    pcfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(QV), use_dora=True)
    model = peft.get_peft_model(hf_model(base), pcfg)
    n_trainable, _ = model.get_nb_trainable_parameters()
    assert lora.trainable_report(lp).trainable_params == n_trainable
    theirs = peft.get_peft_model_state_dict(model)
    ours_m = {
        f"base_model.model.{mod}.lora_magnitude_vector": p["magnitude"]
        for mod, p in per_module(lp).items()
    }
    mags = {k: v.detach().numpy() for k, v in theirs.items() if "magnitude" in k}
    assert sorted(ours_m) == sorted(mags)
    for k, v in mags.items():  # PEFT's init: ‖W‖ per output row
        close(ours_m[k], v, rtol=1e-6)
    lora.save_adapter(lp, tmp_path)
    written = st_numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
    assert {k: (v.shape, str(v.dtype)) for k, v in written.items()} == {
        k: (tuple(v.shape), "float32") for k, v in theirs.items()
    }


def test_gradient_of_the_dora_linear_equals_finite_differences():
    """jax.grad of one DoRA linear = central differences of the detached formula.

    The reference is numpy float64: ``n`` is computed once at the point (a
    constant, as the paper's section 4.3 says), so its differences are PEFT's
    gradient; the gradient through ``n`` differs (checked too: detaching matters).
    """
    rng = np.random.default_rng(0)
    out, fan_in, r, s = 5, 4, 2, 1.5
    w = rng.normal(size=(out, fan_in))
    x = rng.normal(size=(3, fan_in))
    g = rng.normal(size=(3, out))
    a0, b0 = rng.normal(size=(r, fan_in)), rng.normal(size=(out, r))
    m0 = rng.uniform(0.5, 2.0, size=out)
    n0 = np.linalg.norm(w + s * b0 @ a0, axis=1)

    def ref(a, b, m, norm=n0):
        v = x @ w.T + s * (x @ a.T) @ b.T
        return np.sum(g * (m / norm) * v)

    def fd(f, p, eps=1e-6):
        grad = np.zeros_like(p)
        for i in np.ndindex(p.shape):
            d = np.zeros_like(p)
            d[i] = eps
            grad[i] = (f(p + d) - f(p - d)) / (2 * eps)
        return grad

    def ours(a, b, m):
        node = LoRAWeight(jnp.asarray(w, jnp.float32), a, b, alpha=s * r, rank=r,
                          magnitude=m)  # fmt: skip
        return jnp.sum(
            jnp.asarray(g, jnp.float32) * linear(jnp.asarray(x, jnp.float32), node)
        )

    args = [jnp.asarray(v, jnp.float32) for v in (a0, b0, m0)]
    ga, gb, gm = jax.grad(ours, argnums=(0, 1, 2))(*args)
    close(ours(*args), ref(a0, b0, m0), rtol=1e-6)
    close(ga, fd(lambda a: ref(a, b0, m0), a0), rtol=1e-5)
    close(gb, fd(lambda b: ref(a0, b, m0), b0), rtol=1e-5)
    close(gm, fd(lambda m: ref(a0, b0, m), m0), rtol=1e-5)

    def through_norm(a):  # n differentiated too: not what PEFT trains with
        return ref(a, b0, m0, norm=np.linalg.norm(w + s * b0 @ a, axis=1))

    assert np.abs(np.asarray(ga) - fd(through_norm, a0)).max() > 1e-3


def test_dropout_forward_is_pefts_training_forward():
    """With dropout acting: x Wᵀ + (m/n - 1) ⊙ drop(x) Wᵀ + (m/n) s drop(x) Aᵀ Bᵀ."""
    rng = np.random.default_rng(1)
    w, a = rng.normal(size=(6, 8)), rng.normal(size=(2, 8))
    b, x = rng.normal(size=(6, 2)), rng.normal(size=(4, 8))
    m = rng.uniform(0.5, 2.0, size=6)
    node = LoRAWeight(
        *(jnp.asarray(v, jnp.float32) for v in (w, a, b)), alpha=2.0, rank=2,
        dropout=0.5, magnitude=jnp.asarray(m, jnp.float32),
    )  # fmt: skip
    node = lora.with_dropout_keys({"w": node}, key=jax.random.key(4))["w"]
    y = np.asarray(linear(jnp.asarray(x, jnp.float32), node))
    key = jax.random.wrap_key_data(node.dropout_key)
    xd = np.asarray(dropout(jnp.asarray(x, jnp.float32), 0.5, key=key), np.float64)
    assert 0 < (xd == 0).sum() < xd.size  # the same mask as the adapter's input
    scale = m / np.linalg.norm(w + b @ a, axis=1)
    expected = x @ w.T + (scale - 1) * (xd @ w.T) + scale * ((xd @ a.T) @ b.T)
    close(y, expected, rtol=1e-5)


def test_fold_equals_the_unfolded_forward_and_pefts_merge(base):
    """fold: m/‖W+sBA‖ ⊙ (W+sBA); its logits, and PEFT's merge_and_unload weights."""
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=("all-linear",), use_dora=True)
    lp = trained(base, cfg)
    folded = lora.fold(lp)
    close(our_logits(folded), our_logits(lp))
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                           use_dora=True)  # fmt: skip
    model = peft.get_peft_model(hf_model(base), pcfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mod, _, rest = name.removeprefix("base_model.model.").partition(".lora_")
            if rest:
                part = {"A": "A", "B": "B", "m": "magnitude"}[rest[0]]
                p.copy_(torch.from_numpy(per_module(lp)[mod][part]))
    merged = model.merge_and_unload().state_dict()
    for name, w in to_hf_names(folded).items():
        close(w, merged[name].numpy(), rtol=1e-6)


def test_qlora_nf4_base_with_dora_matches_the_dequantized_base():
    """NF4 bases: m starts at ‖deq(W)‖; forward and grads equal DoRA on deq(W)."""
    cfg64 = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    params = cfg64.init(jax.random.key(1))
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=("all-linear",), use_dora=True)
    lq = trained(params, cfg, quantize="nf4")
    node = lq["model"]["layers"]["mlp"]["up_proj"]["weight"]
    assert quant.is_quantized(node.base)
    fresh = lora.apply(params, cfg, key=jax.random.key(3), quantize="nf4")
    m0 = fresh["model"]["layers"]["mlp"]["up_proj"]["weight"].magnitude
    deq = np.asarray(quant.dequantize(node.base), np.float64)  # (L, out, in)
    close(m0, np.linalg.norm(deq, axis=-1), rtol=1e-6)
    dense = jax.tree_util.tree_map(
        lambda x: x.replace(base=quant.dequantize(x.base)) if is_adapter(x) else x,
        lq,
        is_leaf=is_adapter,
    )
    t_q, f_q = lora.split(lq)
    t_d, f_d = lora.split(dense)

    def loss(t, f):
        return jnp.mean(cfg64.apply(lora.combine(t, f), jnp.asarray(TOKENS)) ** 2)

    lq_val, gq = jax.value_and_grad(loss)(t_q, f_q)
    ld_val, gd = jax.value_and_grad(loss)(t_d, f_d)
    close(lq_val, ld_val)
    for x, y in zip(jax.tree_util.tree_leaves(gq), jax.tree_util.tree_leaves(gd)):
        close(x, y)
    close(our_logits(lq, cfg64), our_logits(dense, cfg64))


def test_quantized_stack_is_never_dense_as_a_whole():
    """No (L, out, in) array in the loss's gradient nor in m's init: W per layer."""
    cfg64 = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3,
        num_heads=4, num_kv_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    params = cfg64.init(jax.random.key(1))
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=("all-linear",), use_dora=True)
    lq = lora.apply(params, cfg, key=jax.random.key(3), quantize="nf4")
    t, f = lora.split(lq)

    def loss(t):
        return jnp.mean(cfg64.apply(lora.combine(t, f), jnp.asarray(TOKENS)) ** 2)

    def shapes(closed):
        found = set()

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                found.update(tuple(v.aval.shape) for v in eqn.outvars)
                for p in eqn.params.values():
                    for q in p if isinstance(p, (tuple, list)) else (p,):
                        inner = getattr(q, "jaxpr", q)
                        if hasattr(inner, "eqns"):
                            walk(inner)

        walk(closed.jaxpr)
        return found

    stacks = {(3, o, i) for o, i in [(64, 64), (128, 64), (64, 128), (32, 64)]}
    in_loss = shapes(jax.make_jaxpr(jax.grad(loss))(t))
    assert (128, 64) in in_loss  # one layer's dequantized up_proj
    assert not in_loss & stacks, sorted(in_loss & stacks)
    node = lq["model"]["layers"]["mlp"]["up_proj"]["weight"]
    in_init = shapes(jax.make_jaxpr(dora_norm)(node))
    assert (128, 64) in in_init and (3, 128, 64) not in in_init


def test_load_refuses_what_peft_dora_files_hold_that_is_unsupported(base, tmp_path):
    """Magnitudes without use_dora, use_dora without them, DoRA on embeddings."""
    cfg = LoRAConfig(rank=2, alpha=4.0, targets=QV, use_dora=True)
    lora.save_adapter(lora.apply(base, cfg, key=jax.random.key(0)), tmp_path)
    file = tmp_path / "adapter_config.json"
    settings = json.loads(file.read_text())
    file.write_text(json.dumps({**settings, "use_dora": False}))
    with pytest.raises(CompatibilityError, match=r"lora_magnitude_vector \(DoRA\) but"):
        lora.load_adapter(tmp_path, base)
    plain = tmp_path / "plain"
    lora.save_adapter(lora.apply(base, LoRAConfig(rank=2, targets=QV),
                                 key=jax.random.key(0)), plain)  # fmt: skip
    pfile = plain / "adapter_config.json"
    pfile.write_text(json.dumps({**json.loads(pfile.read_text()), "use_dora": True}))
    with pytest.raises(CompatibilityError, match="no lora_magnitude_vector but"):
        lora.load_adapter(plain, base)
    emb = tmp_path / "emb"
    pcfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["embed_tokens"],
                           use_dora=True)  # fmt: skip
    peft.get_peft_model(hf_model(base), pcfg).save_pretrained(str(emb))
    with pytest.raises(CompatibilityError, match="adapts an embedding"):
        lora.load_adapter(emb, base)


def test_mixed_dora_and_lora_cannot_be_saved_as_one_adapter(base, tmp_path):
    lp = lora.apply(base, LoRAConfig(rank=2, targets=("q_proj",), use_dora=True),
                    key=jax.random.key(0))  # fmt: skip
    lp = lora.apply(lp, LoRAConfig(rank=2, targets=("v_proj",)), key=jax.random.key(1))
    with pytest.raises(CompatibilityError, match="one use_dora"):
        lora.save_adapter(lp, tmp_path)
    with pytest.raises(UnsupportedError, match="DoRA"):
        lora.unfold(lora.fold(lp), lp)


def test_dora_over_gguf_bases_kept_as_stored():
    """GGUF bases kept as stored: DoRA on their dense values, layer by layer.

    A stacked base of mixed GGML types (a BF16 and a Q8_0 layer): ``m``, the scanned
    forward and the fold equal the formula on the dequantized values.
    """
    gguf = pytest.importorskip("gguf")
    from entrenar.nn import to_dense
    from entrenar.quant.ggml_mixed import mixed_ggml_weight

    rng = np.random.default_rng(2)
    w = rng.normal(size=(2, 8, 32)).astype(np.float32)
    bf16 = (w[0].view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    q8 = gguf.quants.quantize(w[1], gguf.GGMLQuantizationType.Q8_0)
    base = mixed_ggml_weight([(bf16, "BF16"), (q8, "Q8_0")], (2, 8, 32))
    params = {"layers": {"q_proj": {"weight": base}}}
    cfg = LoRAConfig(rank=2, alpha=4.0, targets=("q_proj",), use_dora=True)
    node = lora.apply(params, cfg, key=jax.random.key(0), quantize="nf4")
    node = node["layers"]["q_proj"]["weight"]
    assert node.base is base  # kept as stored
    dense = np.asarray(to_dense(base), np.float64)  # (2, 8, 32)
    close(node.magnitude, np.linalg.norm(dense, axis=-1), rtol=1e-6)
    node = node.replace(
        b=jnp.asarray(rng.normal(size=(2, 8, 2)) * 0.1, jnp.float32),
        magnitude=node.magnitude * 1.5,
    )
    x = jnp.asarray(rng.normal(size=(3, 32)), jnp.float32)

    def scanned(n):
        return jax.lax.scan(lambda h, w: (h, linear(x, w)), x, n)[1]  # (2, 3, 8)

    v = dense + node.scale * np.asarray(node.b) @ np.asarray(node.a)  # (2, 8, 32)
    norm = np.linalg.norm(v, axis=-1, keepdims=True)  # (2, 8, 1)
    folded = np.asarray(node.magnitude)[..., None] / norm * v
    want = np.einsum("ti,loi->lto", np.asarray(x, np.float64), folded)  # (2, 3, 8)
    close(scanned(node), want)
    close(lora.fold({"w": node})["w"], folded, rtol=1e-6)


@settings(max_examples=10, deadline=None)
@given(
    out=st.integers(1, 9),
    fan_in=st.integers(1, 9),
    rank=st.integers(1, 3),
    scale=st.floats(0.1, 4.0),
    seed=st.integers(0, 2**16),
)
def test_folded_matrix_is_the_dora_product(out, fan_in, rank, scale, seed):
    """The fold, m/‖W + sBA‖ ⊙ (W + sBA), times x equals the unfolded product."""
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    node = LoRAWeight(
        arr(out, fan_in), arr(rank, fan_in), arr(out, rank), alpha=scale * rank,
        rank=rank, magnitude=jnp.abs(arr(out)) + 0.1,
    )  # fmt: skip
    x = arr(4, fan_in)
    # jitted: op by op, each example's shapes made each operation a program of its own
    folded = np.asarray(jax.jit(lora.fold)({"w": node})["w"], np.float64)
    v = np.asarray(node.base, np.float64) + scale * np.asarray(node.b) @ np.asarray(
        node.a
    )
    want = np.asarray(node.magnitude)[:, None] / np.linalg.norm(v, axis=1)[:, None] * v
    close(folded, want, rtol=1e-5)
    close(jax.jit(linear)(x, node), np.asarray(x, np.float64) @ want.T, rtol=1e-5)


def test_bfloat16_bases_compute_dora_in_float32_and_fold_to_bfloat16(base):
    """A bfloat16 base: m and n from its values in float32, the fold kept bfloat16."""
    b16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), base)
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=("all-linear",), use_dora=True)
    lp = trained(b16, cfg)
    node = lp["model"]["layers"]["mlp"]["up_proj"]["weight"]
    assert node.base.dtype == jnp.bfloat16 and node.magnitude.dtype == jnp.float32
    as32 = jax.tree_util.tree_map(  # the same values, stored float32
        lambda x: (
            x.replace(base=x.base.astype(jnp.float32))
            if is_adapter(x)
            else x.astype(jnp.float32)
        ),
        lp,
        is_leaf=is_adapter,
    )
    want = our_logits(as32)
    close(our_logits(lp), want, rtol=1e-6)
    folded = lora.fold(lp)
    up = folded["model"]["layers"]["mlp"]["up_proj"]["weight"]
    assert up.dtype == jnp.bfloat16
    exact = np.asarray(lora.fold(as32)["model"]["layers"]["mlp"]["up_proj"]["weight"])
    np.testing.assert_array_equal(np.asarray(up), exact.astype(jnp.bfloat16))
    close(our_logits(folded), want, rtol=1e-2)  # bfloat16 rounding of W'


def test_partial_dora_adapter_round_trips_through_peft(base, tmp_path):
    """DoRA on layer 0 only (layers_to_transform): layer 1 is left out again.

    Loaded, layer 1 gets A = B = 0 and m = ‖W‖ (the base's forward).
    """
    pcfg = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["v_proj"], layers_to_transform=[0],
        use_dora=True, init_lora_weights=False,
    )  # fmt: skip
    model = peft.get_peft_model(hf_model(base), pcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.3)
    expected = torch_logits(model)
    model.save_pretrained(str(tmp_path / "peft"))
    loaded = lora.load_adapter(tmp_path / "peft", base)
    node = loaded["model"]["layers"]["self_attn"]["v_proj"]["weight"]
    w1 = np.asarray(base["model"]["layers"]["self_attn"]["v_proj"]["weight"][1])
    close(node.magnitude[1], np.linalg.norm(w1.astype(np.float64), axis=1), rtol=1e-6)
    close(our_logits(loaded), expected)
    lora.save_adapter(loaded, tmp_path / "back")
    theirs = st_numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    ours = st_numpy.load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs) and len(ours) == 3  # layer 0: A, B, m
    again = peft.PeftModel.from_pretrained(hf_model(base), str(tmp_path / "back"))
    close(torch_logits(again.eval()), expected)


def test_saving_and_loading_dora_compiles_the_norms_once(base, tmp_path, caplog):
    """The magnitudes' ``‖W + s B A‖`` of a stacked tree: one program per shape.

    `jax.lax.map` outside a trace wraps a new closure on every call, so each
    `apply`, `save_adapter` and `load_adapter` traced and compiled one program per
    adapted stack again (a tiny Llama: 7 per call).
    """
    cfg = LoRAConfig(rank=2, alpha=4.0, targets=("all-linear",), use_dora=True)
    lp = lora.apply(base, cfg, key=jax.random.key(0))
    lora.save_adapter(lp, tmp_path / "first")
    loaded = lora.load_adapter(tmp_path / "first", base)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        again = lora.apply(base, cfg, key=jax.random.key(1))
        lora.save_adapter(again, tmp_path / "second")
        lora.load_adapter(tmp_path / "second", base)
    compiled = [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
    assert not compiled, compiled
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(lp)):
        np.testing.assert_array_equal(got, want)  # magnitudes written and read
