"""What a mixture of experts does in training beyond the forward pass, vs transformers.

Mixtral's ``router_jitter_noise`` ``j``: in training mode transformers multiplies
each MoE block's input by ``u ~ U(1 - j, 1 + j)`` before the router and the experts
read it. The Trainer's loss with a key is compared, loss and every gradient, with
transformers' training forward fed entrenar's noise (its ``uniform_`` replaced by
the values entrenar drew); the noise itself against the uniform distribution.
LoRA dropout on expert stacks is refused, as PEFT 0.21 refuses ``lora_dropout``
with ``target_parameters``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import io, lora, nn
from entrenar.errors import ConfigError, UnsupportedError
from entrenar.nn.llama import _layer_keys
from entrenar.nn.moe import router_jitter
from entrenar.preference import make_dpo_loss_fn, make_grpo_loss_fn
from entrenar.train import causal_lm_loss_fn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
import moe_cases  # noqa: E402  (needs torch and transformers)

scipy_stats = pytest.importorskip("scipy.stats")

pytestmark = pytest.mark.usefixtures("quick_compiles")
JITTER = 0.3


_models, _batch = moe_cases.models, moe_cases.batch


# ------------------------------------------------------------------- router jitter
def test_jitter_noise_is_uniform_on_the_interval():
    """``u = router_jitter(1, j, key)``: U(1 - j, 1 + j) (Kolmogorov-Smirnov)."""
    n = 20_000
    u = np.asarray(router_jitter(jnp.ones((4, n // 4)), JITTER, jax.random.key(7)))
    u = u.reshape(-1).astype(np.float64)
    assert (u >= 1 - JITTER).all() and (u <= 1 + JITTER).all()
    test = scipy_stats.kstest(u, scipy_stats.uniform(1 - JITTER, 2 * JITTER).cdf)
    assert test.pvalue > 1e-3, test
    assert abs(u.mean() - 1) < 5 * JITTER / np.sqrt(3 * n)  # E u = 1, Var = j²/3
    assert abs(u.var() - JITTER**2 / 3) < 0.05 * JITTER**2 / 3
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)), jnp.float32)
    y = router_jitter(x, JITTER, jax.random.key(7))
    ratio = np.asarray(y) / np.asarray(x)
    assert np.abs(ratio - 1).max() <= JITTER + 1e-6 and np.abs(ratio - 1).max() > 0
    assert router_jitter(x, JITTER, None) is x  # evaluation: untouched


def test_mixtral_training_loss_and_gradients_equal_transformers_jitter(monkeypatch):
    config, params, model = _models("mixtral", router_jitter_noise=JITTER)
    tokens, mask, labels = _batch(config.vocab_size)
    batch = {
        "input_ids": jnp.asarray(tokens),
        "attention_mask": jnp.asarray(mask.astype(bool)),
        "labels": jnp.asarray(labels),
    }
    key = jax.random.key(11)
    # the noise entrenar draws in each layer: router_jitter of ones
    shape = (*tokens.shape, config.hidden_size)
    noise = [
        torch.from_numpy(np.array(router_jitter(
            jnp.ones(shape), JITTER, jax.random.wrap_key_data(k)
        )))
        for k in _layer_keys(key, config.num_layers)
    ]  # fmt: skip
    drawn = []

    def uniform_(self, low, high, *args, **kwargs):  # transformers' jitter draw
        assert (low, high) == pytest.approx((1 - JITTER, 1 + JITTER))
        drawn.append(self.shape)
        return self.copy_(noise[len(drawn) - 1])

    model.train()  # Mixtral's dropouts are 0: only the jitter differs from eval
    monkeypatch.setattr(torch.Tensor, "uniform_", uniform_)
    out = model(
        torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
        labels=torch.from_numpy(labels),
    )  # fmt: skip
    out.loss.backward()
    monkeypatch.undo()
    assert drawn == [torch.Size(shape)] * config.num_layers  # one draw a layer
    loss_fn = causal_lm_loss_fn(config)
    loss, grads = jax.jit(
        jax.value_and_grad(lambda p: loss_fn(p, batch, key=key)[0])
    )(params)  # fmt: skip
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    want = {n: p.grad.numpy() for n, p in model.named_parameters()}
    want = nn.to_hf_names(
        nn.from_hf_names(
            nn.architecture("mixtral").from_hf_tensors(want, config), config
        )
    )
    got = nn.to_hf_names(grads)
    assert set(got) == set(want)
    for name, g in got.items():
        np.testing.assert_allclose(
            np.asarray(g), want[name], atol=2e-6, rtol=1e-3, err_msg=name
        )
    plain = float(loss_fn(params, batch, key=None)[0])  # evaluation: no jitter
    model.eval()
    with torch.no_grad():
        ev = model(
            torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
            labels=torch.from_numpy(labels),
        ).loss.item()  # fmt: skip
    np.testing.assert_allclose(plain, ev, rtol=1e-5)
    assert abs(plain - float(loss)) > 1e-4  # the jitter mattered


def test_jitter_is_read_written_and_checked(tmp_path):
    arch = nn.architecture("mixtral")
    config = dataclasses.replace(arch.tiny(), router_jitter_noise=0.01)
    path = tmp_path / "m.gguf"  # llama.cpp has no key: entrenar.family keeps it
    io.save_llama_gguf(path, config, config.init(jax.random.key(0)))
    assert io.load_llama_gguf(path)[0] == config
    hf = arch.to_hf(config)
    assert hf["router_jitter_noise"] == 0.01
    assert arch.from_hf(hf) == config
    assert transformers.AutoConfig.for_model(**hf).router_jitter_noise == 0.01
    del hf["router_jitter_noise"]
    assert arch.from_hf(hf).router_jitter_noise == 0.0  # transformers' default
    qwen = dataclasses.replace(nn.architecture("qwen3_moe").tiny(), **{
        "router_jitter_noise": 0.01
    })  # fmt: skip
    with pytest.raises(UnsupportedError, match="router_jitter_noise"):
        nn.architecture("qwen3_moe").to_hf(qwen)
    with pytest.raises(ConfigError, match=r"router_jitter_noise must be in \[0, 1\)"):
        dataclasses.replace(config, router_jitter_noise=1.5)
    with pytest.raises(ConfigError, match="router_jitter_noise needs num_experts"):
        dataclasses.replace(nn.architecture("llama").tiny(), router_jitter_noise=0.1)
    for make, method in ((make_dpo_loss_fn, "DPO"), (make_grpo_loss_fn, "GRPO")):
        with pytest.raises(UnsupportedError, match=f"{method} does not apply"):
            make(config)


# ------------------------------------------------------------ LoRA dropout, experts
def test_lora_dropout_on_experts_is_refused_as_peft_refuses():
    _, params, model = _models("qwen3_moe")
    targets = ("q_proj", "experts.down_proj")
    with pytest.raises(ValueError, match="does not work with lora_dropout"):
        peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj"],
                target_parameters=["mlp.experts.down_proj"],
            ),
        )  # fmt: skip
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=targets, dropout=0.1)
    with pytest.raises(UnsupportedError, match=r"experts\.down_proj.*stack of experts"):
        lora.apply(params, cfg, key=jax.random.key(0))
    # dropout on the linear modules alone, and experts without dropout: both take it
    attention = dataclasses.replace(cfg, targets=("q_proj",))
    lp = lora.apply(params, attention, key=jax.random.key(0))
    assert lp["model"]["layers"]["self_attn"]["q_proj"]["weight"].dropout == 0.1
    lora.apply(params, dataclasses.replace(cfg, dropout=0.0), key=jax.random.key(0))
    _, _, fresh = _models("qwen3_moe")
    peft.get_peft_model(
        fresh,
        peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj"]),
    )
