"""The Tensor-API wrappers (SGD, Adam, AdamW, clip_grad_norm) against torch.optim."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import optim as eo
from entrenar.autograd import Tensor, backward
from entrenar.errors import ConfigError, ShapeError, TapeError

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)
W0 = RNG.normal(size=(3, 4)).astype(np.float32)
B0 = RNG.normal(size=(4,)).astype(np.float32)
X = RNG.normal(size=(5, 3)).astype(np.float32)


def _entrenar_loss(w, b):
    y = Tensor(X) @ w + b  # (5, 4)
    return (y * y).mean()


def _torch_loss(w, b):
    y = torch.from_numpy(X) @ w + b
    return (y * y).mean()


CASES = {
    "sgd": (lambda: eo.SGD(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_momentum_nesterov_wd": (
        lambda: eo.SGD(0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda p: torch.optim.SGD(
            p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
        ),
    ),
    "adam": (lambda: eo.Adam(0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    "adamw": (
        lambda: eo.AdamW(0.01, weight_decay=0.1, beta1=0.8, beta2=0.99, eps=1e-6),
        lambda p: torch.optim.AdamW(
            p, lr=0.01, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrapper_matches_torch_with_lr_changes_and_clipping(name):
    ours_f, theirs_f = CASES[name]
    w, b = Tensor(W0, requires_grad=True), Tensor(B0, requires_grad=True)
    tw = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    tb = torch.nn.Parameter(torch.from_numpy(B0.copy()))
    opt, topt = ours_f(), theirs_f([tw, tb])
    sched = eo.CosineScheduler(opt.lr, opt.lr / 10, 20)
    for step in range(20):
        opt.set_lr(sched.get_lr(step))
        for g in topt.param_groups:
            g["lr"] = sched.get_lr(step)
        backward(_entrenar_loss(w, b))
        norm = eo.clip_grad_norm([w, b], 0.5)
        opt.step([w, b])
        opt.zero_grad([w, b])
        topt.zero_grad()
        _torch_loss(tw, tb).backward()
        tnorm = torch.nn.utils.clip_grad_norm_([tw, tb], 0.5)
        topt.step()
        assert float(norm) == pytest.approx(float(tnorm), rel=1e-4)
        assert w.grad is None and b.grad is None
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b.numpy(), tb.detach().numpy(), rtol=1e-4, atol=1e-5)
    assert opt.lr == pytest.approx(sched.get_lr(19))


def test_tensors_without_grad_are_skipped_and_keep_their_state():
    w = Tensor(W0, requires_grad=True)
    frozen = Tensor(B0, requires_grad=False)
    opt = eo.Adam(0.1)
    backward((w * w).sum())
    opt.step([w, frozen])
    assert opt.state_of(frozen) is None
    np.testing.assert_array_equal(frozen.numpy(), B0)
    assert int(opt.state_of(w)[0].count) == 1
    opt.zero_grad([w])
    opt.step([w])  # no grad: nothing happens
    assert int(opt.state_of(w)[0].count) == 1


def test_one_compile_across_steps_and_lr_changes():
    w = Tensor(W0, requires_grad=True)
    opt = eo.AdamW(0.01)
    for step in range(4):
        opt.set_lr(0.01 / (step + 1))
        backward((w * w).sum())
        opt.step([w])
        opt.zero_grad([w])
    assert opt._step_fn._cache_size() == 1


def test_bf16_state_for_tensors():
    w = Tensor(W0, requires_grad=True)
    opt = eo.Adam(0.01, state_dtype=jnp.bfloat16)
    backward((w * w).sum())
    opt.step([w])
    assert opt.state_of(w)[0].mu.dtype == jnp.bfloat16


def test_clip_grad_norm_leaves_small_grads_and_skips_none():
    w = Tensor([0.3, 0.4], requires_grad=True)
    b = Tensor([1.0], requires_grad=True)
    backward((w * w).sum() * 0.5)
    norm = eo.clip_grad_norm([w, b], 10.0)
    assert float(norm) == pytest.approx(0.5)
    np.testing.assert_allclose(np.asarray(w.grad), [0.3, 0.4], rtol=1e-6)
    assert b.grad is None


def test_wrapper_errors():
    with pytest.raises(ConfigError, match="number"):
        eo.Adam(eo.cosine_decay_schedule(0.1, 10))
    with pytest.raises(ConfigError, match="max_norm"):
        eo.clip_grad_norm([], 0.0)
    w = Tensor(W0, requires_grad=True)
    opt = eo.SGD(0.1, momentum=0.9)
    backward((w * w).sum())
    opt.step([w])
    w.data = jnp.ones((2, 2))
    w.grad = jnp.ones((2, 2))
    with pytest.raises(ShapeError, match="changed shape"):
        opt.step([w])


def test_step_during_a_live_tape_raises_before_touching_the_state():
    w = Tensor(W0, requires_grad=True)
    opt = eo.SGD(0.1, momentum=0.9)
    backward((w * w).sum())
    opt.step([w])
    before = np.asarray(opt.state_of(w)[0].trace).copy()
    y = w * 2.0  # a recorded operation still needs w
    w.grad = jnp.ones_like(w.data)
    with pytest.raises(TapeError):
        opt.step([w])
    np.testing.assert_array_equal(np.asarray(opt.state_of(w)[0].trace), before)
    del y


@pytest.mark.parametrize(
    ("name", "make_tensor_opt", "make_tx"),
    [
        (
            "adam8bit",
            lambda: eo.Adam8bit(0.02, beta2=0.99),
            lambda: eo.adam_8bit(0.02, b2=0.99),
        ),
        (
            "adamw8bit",
            lambda: eo.AdamW8bit(0.02, weight_decay=0.1),
            lambda: eo.adamw_8bit(0.02, weight_decay=0.1),
        ),
    ],
)
def test_8bit_wrappers_are_the_pure_8bit_optimizers_step_for_step(
    name, make_tensor_opt, make_tx
):
    """The 8-bit wrappers give the pure optimizers' params and 8-bit states.

    `Adam8bit`/`AdamW8bit` on tensors against `adam_8bit`/`adamw_8bit` on arrays:
    uint8 codes + absmax for the 5,000-value tensor, float32 moments for the small
    one, with a learning-rate change on the way.
    """
    rng = np.random.default_rng(1)
    big0 = rng.normal(size=(50, 100)).astype(np.float32)  # over min_8bit_size
    x = rng.normal(size=(7, 50)).astype(np.float32)
    big, small = Tensor(big0, requires_grad=True), Tensor(B0, requires_grad=True)
    opt, tx = make_tensor_opt(), make_tx()

    def pure_loss(p):
        y = jnp.asarray(x) @ p["big"][:, :4] + p["small"]  # (7, 4)
        return (y * y).mean()

    params = {"big": jnp.asarray(big0), "small": jnp.asarray(B0)}
    state = tx.init(params)
    for lr in [0.02, 0.02, 0.005, 0.005]:
        opt.set_lr(lr)
        backward(((Tensor(x) @ big[:, :4] + small) ** 2).mean())
        opt.step([big, small])
        opt.zero_grad([big, small])
        grads = jax.grad(pure_loss)(params)
        state = eo.set_lr(state, lr)
        updates, state = tx.update(grads, state, params)
        params = eo.apply_updates(params, updates)
        np.testing.assert_allclose(big.numpy(), params["big"], rtol=0, atol=2e-7)
        np.testing.assert_allclose(small.numpy(), params["small"], rtol=0, atol=2e-7)
    moments = opt.state_of(big)[0].mu
    assert isinstance(moments, eo.Blockwise8bit) and moments.codes.dtype == np.uint8
    assert isinstance(opt.state_of(small)[0].mu, jax.Array)
    assert not np.allclose(big.numpy(), big0)  # it trained
