"""Every registered decoder family, split over 4 simulated CPU devices, computes as one.

Each `LlamaConfig` family's tiny model (every switch of the family on) is placed
with FSDP on a ``{"fsdp": 4}`` mesh (`distributed.ShardingRules(min_size=0)`: every
leaf the rules can split is split, the new families' leaves included: OLMo 2's
``(L, H d)`` q/k norms, Gemma's four norms, Phi-3's fused projections), and its
logits and the gradients of a LoRA loss on every linear layer equal those of the
unplaced model to float32 rounding. The device count is fixed when jax starts, so
the check runs in a subprocess (as tests/distributed/test_multidevice.py's).
"""

import json
import os
import subprocess
import sys

import pytest

CHECK = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from entrenar import distributed, lora, nn

mesh = distributed.make_mesh({"fsdp": 4})
rules = distributed.ShardingRules(min_size=0)
report = {}
for arch in nn.architectures():
    if arch.config_class is not nn.LlamaConfig or arch.tiny is None:
        continue
    c = arch.tiny()
    base = c.init(jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 1000))
    base = jax.tree.map(  # norm gains and biases away from 1 and 0
        lambda a: a + 0.1 * jax.random.normal(next(keys), a.shape, a.dtype), base
    )
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets="all-linear")
    adapted = lora.apply(base, cfg, key=jax.random.key(3))
    adapted = jax.tree.map(
        lambda x: x.replace(b=x.b + 0.1) if isinstance(x, lora.LoRAWeight) else x,
        adapted, is_leaf=lambda x: isinstance(x, lora.LoRAWeight),
    )
    tokens = jnp.asarray(np.arange(24).reshape(2, 12) * 7 % c.vocab_size)

    def loss(trainable, frozen):
        logits = c.apply(lora.combine(trainable, frozen), tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), logits

    step = jax.jit(jax.grad(loss, has_aux=True))
    trainable, frozen = lora.split(adapted)
    want_g, want = step(trainable, frozen)
    placed = distributed.shard_params(adapted, mesh, rules)
    split = sum(
        len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated
        for x in jax.tree_util.tree_leaves(placed)
    )
    got_g, got = step(*lora.split(placed))
    report[arch.name] = {
        "logits": float(jnp.max(jnp.abs(got - want))),
        "grads": max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree_util.tree_leaves(got_g),
                            jax.tree_util.tree_leaves(want_g))
        ),
        "scale": float(jnp.max(jnp.abs(want))),
        "split_leaves": int(split),
    }
json.dump(report, sys.stdout)
"""


@pytest.mark.slow
def test_every_family_on_four_devices_equals_one_device():
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        # tiny models, as tests/nn/test_families.py's quick_compiles: both sides of
        # the comparison compile without most XLA optimizations (4 families, cold
        # cache: 45.1 -> 29.4 CPU-s), and XLA:CPU emits its fusions with the older
        # elemental emitter, which compiles these programs 2 to 3 times faster than
        # the MLIR fusion emitters (28 families, cold: 196 -> 101 CPU-s)
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
        "--xla_cpu_use_fusion_emitters=false",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
    }
    p = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.loads(p.stdout)
    assert {"gemma", "smollm3", "olmo2", "olmo3", "granite"} <= set(report)
    for name, r in report.items():
        assert r["split_leaves"] > 5, (name, r)  # the model is really split
        assert r["scale"] > 0.1, (name, r)
        assert r["logits"] < 1e-5 * max(1.0, r["scale"]), (name, r)
        assert r["grads"] < 1e-5, (name, r)
