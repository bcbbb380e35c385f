"""Adapter files against the real Hugging Face PEFT on a tiny LlamaForCausalLM."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peft_cases import CFG

from entrenar import lora
from entrenar.errors import CompatibilityError, FormatError, UnsupportedError
from entrenar.lora import LoRAConfig, LoRAWeight
from entrenar.nn import to_hf_names

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
st_numpy = pytest.importorskip("safetensors.numpy")

TOKENS = np.array([[1, 5, 9, 2, 33, 7, 60, 3], [4, 4, 8, 15, 16, 23, 42, 0]])


@pytest.fixture(scope="module")
def base():
    params = CFG.init(jax.random.key(0))
    return params


def hf_model(params):
    """A LlamaForCausalLM holding exactly ``params``."""
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**CFG.to_hf_config())
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in to_hf_names(params).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def torch_logits(model):
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


def our_logits(params):
    return np.asarray(CFG.apply(params, jnp.asarray(TOKENS)))


def trained(params, cfg, seed=3):
    """``lora.apply`` with non-zero B (as after training)."""
    lp = lora.apply(params, cfg, key=jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def fill(x):
        if isinstance(x, LoRAWeight):
            b = (rng.normal(size=x.b.shape) * 0.05).astype(np.float32)
            return x.replace(b=jnp.asarray(b))
        return x

    return jax.tree_util.tree_map(fill, lp, is_leaf=lambda x: isinstance(x, LoRAWeight))


def test_adapter_written_here_loads_in_peft(base, tmp_path):
    model = hf_model(base)
    np.testing.assert_allclose(torch_logits(model), our_logits(base), atol=1e-4)
    lp = trained(base, LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj")))
    ours = our_logits(lp)
    assert np.abs(ours - our_logits(base)).max() > 1e-3  # the adapter matters
    lora.save_adapter(lp, tmp_path, base_model_name_or_path="tiny-llama")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    names = st_numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
    assert names[
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    ].shape == (4, 32)
    assert names[
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    ].shape == (16, 4)
    assert len(names) == 2 * 2 * 2
    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path)).eval()
    np.testing.assert_allclose(torch_logits(peft_model), ours, atol=1e-4)
    back = lora.load_adapter(tmp_path, base)
    np.testing.assert_array_equal(our_logits(back), ours)


def test_rslora_and_partial_targets_round_trip_through_peft(base, tmp_path):
    cfg = LoRAConfig(
        rank=2, alpha=3.0, targets=r"layers\.\d+\.mlp\.up_proj", rslora=True
    )
    lp = trained(base, cfg)
    lora.save_adapter(lp, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(hf_model(base), str(tmp_path)).eval()
    np.testing.assert_allclose(torch_logits(peft_model), our_logits(lp), atol=1e-4)


def test_adapter_saved_by_peft_loads_here(base, tmp_path):
    model = hf_model(base)
    pcfg = peft.LoraConfig(
        r=3, lora_alpha=6, target_modules=["k_proj", "o_proj", "down_proj"],
        init_lora_weights=False, lora_dropout=0.0,
    )  # fmt: skip
    peft_model = peft.get_peft_model(model, pcfg).eval()
    expected = torch_logits(peft_model)
    peft_model.save_pretrained(str(tmp_path))
    loaded = lora.load_adapter(tmp_path, base)
    node = loaded["model"]["layers"]["mlp"]["down_proj"]["weight"]
    assert isinstance(node, LoRAWeight) and node.rank == 3 and node.scale == 2.0
    assert node.a.shape == (2, 3, 48) and node.b.shape == (2, 32, 3)
    np.testing.assert_allclose(our_logits(loaded), expected, atol=1e-4)


def write_peft_by_hand(folder, tensors, config):
    os.makedirs(folder, exist_ok=True)
    st_numpy.save_file(tensors, os.path.join(folder, "adapter_model.safetensors"),
                       metadata={"format": "pt"})  # fmt: skip
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def test_hand_written_peft_file_gives_the_merged_forward(base, tmp_path):
    rng = np.random.default_rng(11)
    tensors, deltas = {}, {}
    for i in range(2):
        m = f"model.layers.{i}.mlp.gate_proj"
        a = rng.normal(size=(5, 32)).astype(np.float32) * 0.1
        b = rng.normal(size=(48, 5)).astype(np.float32) * 0.1
        tensors[f"base_model.model.{m}.lora_A.weight"] = a
        tensors[f"base_model.model.{m}.lora_B.weight"] = b
        deltas[i] = (7.0 / 5) * b @ a  # alpha_pattern overrides lora_alpha
    config = {
        "peft_type": "LORA",
        "r": 5,
        "lora_alpha": 16,
        "alpha_pattern": {"gate_proj": 7},
        "target_modules": ["gate_proj"],
    }
    write_peft_by_hand(tmp_path, tensors, config)
    loaded = lora.load_adapter(tmp_path, base)
    w = np.array(base["model"]["layers"]["mlp"]["gate_proj"]["weight"])
    merged_ref = jax.tree_util.tree_map(lambda x: x, base)
    merged_ref["model"]["layers"]["mlp"]["gate_proj"]["weight"] = jnp.asarray(
        w + np.stack([deltas[0], deltas[1]])
    )
    np.testing.assert_allclose(our_logits(loaded), our_logits(merged_ref), atol=1e-5)


def test_load_reports_every_mismatch(base, tmp_path):
    rng = np.random.default_rng(0)

    def t(*shape):
        return rng.normal(size=shape).astype(np.float32)

    p = "base_model.model.model.layers"
    tensors = {
        f"{p}.0.self_attn.q_proj.lora_A.weight": t(4, 32),
        f"{p}.0.self_attn.q_proj.lora_B.weight": t(32, 4),  # only layer 0 of 2
        f"{p}.0.self_attn.k_proj.lora_A.weight": t(4, 31),  # wrong in
        f"{p}.0.self_attn.k_proj.lora_B.weight": t(16, 4),
        f"{p}.1.self_attn.k_proj.lora_A.weight": t(4, 32),
        f"{p}.1.self_attn.k_proj.lora_B.weight": t(16, 4),
        f"{p}.0.self_attn.qq_proj.lora_A.weight": t(4, 32),  # unknown module
        f"{p}.0.self_attn.qq_proj.lora_B.weight": t(32, 4),
        f"{p}.0.mlp.up_proj.lora_A.weight": t(4, 32),  # B missing
        f"{p}.0.mlp.gate_proj.lora_A.weight": t(2, 32),  # rank 2, config says 4
        f"{p}.0.mlp.gate_proj.lora_B.weight": t(48, 2),
    }
    write_peft_by_hand(
        tmp_path, tensors, {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    )
    with pytest.raises(CompatibilityError) as err:
        lora.load_adapter(tmp_path, base)
    msg = str(err.value)
    assert "'model.layers.0.self_attn.k_proj': lora_A (4, 31)" in msg
    assert "qq_proj' is not in the base model (closest base module: " in msg
    assert "up_proj' has lora_A only" in msg
    assert "gate_proj': lora_A (2, 32) / lora_B (48, 2)" in msg and "rank 4" in msg
    assert "covers" not in msg  # q_proj on layer 0 only is an adapter PEFT writes


def test_load_rejects_bad_files(base, tmp_path):
    with pytest.raises(FormatError, match=r"adapter_config\.json"):
        lora.load_adapter(tmp_path, base)
    good = {
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": np.zeros(
            (2, 32), np.float32
        )
    }
    write_peft_by_hand(tmp_path, good, {"peft_type": "LORA", "r": 2, "lora_alpha": 2})
    f = tmp_path / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-8])  # truncated
    with pytest.raises(FormatError, match="data_offsets"):
        lora.load_adapter(tmp_path, base)
    f.write_bytes(b"\xff" * 16)
    with pytest.raises(FormatError, match="header length"):
        lora.load_adapter(tmp_path, base)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    with pytest.raises(FormatError, match="'r'"):
        lora.load_adapter(tmp_path, base)
    (tmp_path / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 2, "lora_alpha": 2, "use_qalora": true}'
    )
    with pytest.raises(UnsupportedError, match="use_qalora"):
        lora.load_adapter(tmp_path, base)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(FormatError, match=r"line 1, column 2: invalid JSON"):
        lora.load_adapter(tmp_path, base)


def test_exact_module_names_when_a_suffix_would_adapt_more(tmp_path):
    """Only ``a.q_proj`` is adapted: target_modules must not also catch ``b.q_proj``."""
    rng = np.random.default_rng(2)
    w = {k: rng.normal(size=(6, 4)).astype(np.float32) for k in "ab"}
    params = {k: {"q_proj": {"weight": jnp.asarray(v)}} for k, v in w.items()}
    lp = trained(params, LoRAConfig(rank=2, alpha=2.0, targets="a.q_proj"))
    lp["b"] = trained(params, LoRAConfig(rank=3, alpha=1.0, targets="b.q_proj"), 9)["b"]
    lora.save_adapter(lp, tmp_path, task_type=None)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] in (2, 3) and cfg["rank_pattern"] and cfg["alpha_pattern"]

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Module()
            self.b = torch.nn.Module()
            self.a.q_proj = torch.nn.Linear(4, 6, bias=False)
            self.b.q_proj = torch.nn.Linear(4, 6, bias=False)

        def forward(self, x):
            return self.a.q_proj(x) + self.b.q_proj(x)

    model = Two()
    with torch.no_grad():
        for k in "ab":
            getattr(model, k).q_proj.weight.copy_(torch.from_numpy(w[k]))
    pm = peft.PeftModel.from_pretrained(model, str(tmp_path)).eval()
    x = rng.normal(size=(3, 4)).astype(np.float32)
    with torch.no_grad():
        expected = pm(torch.from_numpy(x)).numpy()

    def ours(p):
        from entrenar.nn import linear

        return np.asarray(linear(x, p["a"]["q_proj"]["weight"]) +
                          linear(x, p["b"]["q_proj"]["weight"]))  # fmt: skip

    np.testing.assert_allclose(ours(lp), expected, atol=1e-5)
    np.testing.assert_allclose(ours(lora.load_adapter(tmp_path, params)), expected,
                               atol=1e-5)  # fmt: skip
    # Only a.q_proj adapted: a suffix list ["q_proj"] would wrap b.q_proj as well.
    only_a = trained(params, LoRAConfig(rank=2, alpha=2.0, targets="a.q_proj"))
    lora.save_adapter(only_a, tmp_path / "a", task_type=None)
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert isinstance(cfg["target_modules"], str)
    pm = peft.PeftModel.from_pretrained(Two(), str(tmp_path / "a"))
    wrapped = [n for n, _ in pm.named_modules() if n.endswith("q_proj.lora_A")]
    assert wrapped == ["base_model.model.a.q_proj.lora_A"]


def test_bfloat16_adapter_written_by_torch_loads_as_float32(base, tmp_path):
    st_torch = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(0)
    tensors, ref = {}, {}
    for i in range(2):
        m = f"model.layers.{i}.self_attn.o_proj"
        a = torch.randn(2, 32, generator=gen).to(torch.bfloat16)
        b = torch.randn(32, 2, generator=gen).to(torch.bfloat16)
        tensors[f"base_model.model.{m}.lora_A.default.weight"] = a
        tensors[f"base_model.model.{m}.lora_B.default.weight"] = b
        ref[i] = (a.float().numpy(), b.float().numpy())
    os.makedirs(tmp_path, exist_ok=True)
    st_torch.save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, "use_rslora": True})
    )
    node = lora.load_adapter(tmp_path, base)["model"]["layers"]["self_attn"]["o_proj"][
        "weight"
    ]
    assert node.a.dtype == jnp.float32 and node.rslora and node.scale == 2 / 2**0.5
    np.testing.assert_array_equal(node.a, np.stack([ref[0][0], ref[1][0]]))
    np.testing.assert_array_equal(node.b, np.stack([ref[0][1], ref[1][1]]))


def test_adapter_config_written_is_peft_lora_config_in_full(base, tmp_path):
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"), dropout=0.1)
    lora.save_adapter(trained(base, cfg), tmp_path, base_model_name_or_path="tiny")
    with open(tmp_path / "adapter_config.json", encoding="utf-8") as f:
        written = json.load(f)
    targets = written.pop("target_modules")
    assert written == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
        "r": 4,
        "lora_alpha": 8.0,
        "lora_dropout": 0.1,
        "use_rslora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "use_dora": False,
    }
    assert sorted(targets) == ["q_proj", "v_proj"]  # PEFT's suffix form
    back = lora.load_adapter(tmp_path, base)
    node = back["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert node.dropout == pytest.approx(0.1) and node.rslora is False
    # another PEFT method is refused by name; a missing peft_type means LoRA
    written |= {"target_modules": targets, "peft_type": "IA3"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(written))
    with pytest.raises(UnsupportedError, match=r"peft_type 'IA3'; only LORA"):
        lora.load_adapter(tmp_path, base)
    del written["peft_type"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(written))
    lora.load_adapter(tmp_path, base)


def peft_adapter(folder, **settings):
    """A PEFT adapter with random A and B saved to ``folder``, and its logits."""
    settings = {"r": 4, "lora_alpha": 8, "init_lora_weights": False, **settings}
    model = peft.get_peft_model(
        hf_model(CFG.init(jax.random.key(0))), peft.LoraConfig(**settings)
    ).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(str(folder))
    return torch_logits(model)


@pytest.mark.parametrize(
    "settings",
    [
        {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
        {"target_modules": ["q_proj"], "layers_to_transform": 0,
         "layers_pattern": "layers"},
        {"target_modules": "all-linear",
         "exclude_modules": ["model.layers.0.mlp.down_proj", "k_proj"]},
        {"target_modules": ["q_proj", "up_proj"],
         "exclude_modules": r".*layers\.1\..*"},
        {"target_modules": r".*\.layers\.0\.self_attn\.(q|k)_proj"},
        {"target_modules": ["o_proj"], "fan_in_fan_out": True},
        {"target_modules": [], "target_parameters": ["self_attn.q_proj.weight"]},
    ],
)  # fmt: skip
def test_adapter_on_some_layers_loads_and_saves_back_as_peft_wrote_it(
    base, tmp_path, settings
):
    """PEFT's layers_to_transform / exclude_modules: zero adapters elsewhere here."""
    expected = peft_adapter(tmp_path / "peft", **settings)
    loaded = lora.load_adapter(tmp_path / "peft", base)
    np.testing.assert_allclose(our_logits(loaded), expected, atol=1e-6)
    lora.save_adapter(loaded, tmp_path / "back")  # the same tensors, no zero ones
    theirs = st_numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    ours = st_numpy.load_file(str(tmp_path / "back" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, x in ours.items():
        np.testing.assert_array_equal(x, theirs[name])
    again = peft.PeftModel.from_pretrained(hf_model(base), str(tmp_path / "back"))
    np.testing.assert_allclose(torch_logits(again.eval()), expected, atol=1e-6)
    wrapped = {n for n, _ in again.named_modules() if n.endswith(".lora_A")}
    assert len(wrapped) == len(theirs) // 2  # no module adapted that PEFT had not


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa' is not supp"),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora' is not supp"),
        ({"alora_invocation_tokens": [9, 2]}, "alora_invocation_tokens=[9, 2]"),
        ({"lora_bias": True}, "lora_bias=True is not supported"),
        ({"use_qalora": True}, "use_qalora=True is not supported"),
    ],
)
def test_adapters_peft_computes_differently_are_refused_by_key(
    base, tmp_path, settings, message
):
    """Settings that change PEFT's forward are refused, naming the key.

    Before, pissa, olora and alora loaded with other logits than PEFT's, silently,
    and lora_bias failed with 'tensor ...lora_B.bias is not a LoRA A/B weight'.
    """
    peft_adapter(tmp_path, target_modules=["q_proj"], **settings)
    with pytest.raises(UnsupportedError, match=re.escape(message)):
        lora.load_adapter(tmp_path, base)


def test_layers_of_one_weight_with_different_ranks_load(base, tmp_path):
    """rank_pattern by layer: padded to rank 4, with PEFT's logits.

    Refused before ('its layers have ranks [2, 4]'); more in test_lora_rank_pattern.
    """
    key = r"layers\.1\.self_attn\.q_proj"
    expected = peft_adapter(tmp_path, target_modules=["q_proj"], rank_pattern={key: 2})
    loaded = lora.load_adapter(tmp_path, base)
    q = loaded["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert q.layer_ranks == (4, 2) and q.a.shape[-2] == 4
    np.testing.assert_allclose(our_logits(loaded), expected, atol=1e-6)


def test_zero_layers_of_a_partial_adapter_stay_zero_in_training(base, tmp_path):
    """Layers without adapter get zero gradients, so they stay zero in training.

    A trained adapter then saves back the same layers (save_adapter leaves out
    layers with A = 0 and B = 0).
    """
    peft_adapter(tmp_path, target_modules=["v_proj"], layers_to_transform=[0])
    trainable, frozen = lora.split(lora.load_adapter(tmp_path, base))

    def loss(t):
        return jnp.mean(CFG.apply(lora.combine(t, frozen), jnp.asarray(TOKENS)) ** 2)

    grads = jax.grad(loss)(trainable)
    g = grads["model"]["layers"]["self_attn"]["v_proj"]["weight"]
    assert np.abs(np.asarray(g.b[0])).max() > 0  # layer 0 trains
    assert not np.asarray(g.a[1]).any() and not np.asarray(g.b[1]).any()
