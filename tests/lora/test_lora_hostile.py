"""Hostile adapter configs and target patterns: a clear error at once, never a hang."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_helpers import make_params

from entrenar import lora
from entrenar.errors import CompatibilityError, ConfigError, FormatError
from entrenar.lora import LoRAConfig
from entrenar.lora.config import target_matches
from entrenar.lora.patterns import PEFT_KEY, check_pattern, peft_key_matches

CFG = LoRAConfig(rank=2, alpha=4.0, targets=("up_proj", "down_proj"))
EVIL = r"(.*.*.*.*.*.*.*.*.*.*)*\$x"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """``(folder, base params, config dict)`` of a saved two-target adapter."""
    folder = tmp_path_factory.mktemp("adapter")
    base = make_params()
    lora.save_adapter(lora.apply(base, CFG, key=jax.random.key(0)), folder)
    return folder, base, json.loads((folder / "adapter_config.json").read_text())


def _load_with(adapter, text: str):
    folder, base, _ = adapter
    (folder / "adapter_config.json").write_text(text)
    return lora.load_adapter(folder, base)


@pytest.mark.parametrize("key", ["rank_pattern", "alpha_pattern"])
def test_a_catastrophic_pattern_key_is_refused_at_once(adapter, key, deadline):
    cfg = {**adapter[2], key: {EVIL: 2}}
    with (
        deadline(10),
        pytest.raises(FormatError, match=rf"adapter_config\.json: {key}"),
    ):
        _load_with(adapter, json.dumps(cfg))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"lora_dropout": 5}, r"'lora_dropout' = 5 must be a number in \[0, 1\)"),
        ({"lora_dropout": float("inf")}, "'lora_dropout' = inf"),
        ({"lora_dropout": float("nan")}, "'lora_dropout' = nan"),
        ({"lora_dropout": "DORA"}, "'lora_dropout' = 'DORA'"),
        ({"lora_alpha": float("nan")}, "'lora_alpha' = nan must be a finite number"),
        ({"r": -1}, "'r' = -1 must be an integer > 0"),
        ({"r": 2.0}, "'r' = 2.0 must be an integer"),
        ({"r": True}, "'r' = True must be an integer"),
        ({"use_rslora": "yes"}, "'use_rslora' = 'yes' must be true or false"),
        ({"rank_pattern": ["x"]}, r"'rank_pattern' = \['x'\] must be an object"),
        ({"rank_pattern": {"q_proj": "8"}}, r"rank_pattern\['q_proj'\] = '8' must"),
        ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\] = 0 must"),
        ({"rank_pattern": {"": 4}}, "rank_pattern has an empty pattern"),
        ({"rank_pattern": {"(q": 4}}, r"rank_pattern: '\(q' is not a valid regex"),
        ({"rank_pattern": {"(?=q)q": 4}}, "lookarounds"),
        ({"alpha_pattern": {"q_proj": float("nan")}}, r"alpha_pattern\['q_proj'\]"),
        ({"target_modules": 5}, "'target_modules' = 5 must be a regex or a list"),
        ({"target_modules": ["q", 1]}, "'target_modules'"),
        ({"target_modules": "(a*)*b"}, r"target_modules: '\(a\*\)\*b': could match"),
    ],
)
def test_bad_adapter_fields_are_format_errors_naming_the_key(
    adapter, change, match, deadline
):
    cfg = {**adapter[2], **change}
    with deadline(10), pytest.raises(FormatError, match=match):
        _load_with(adapter, json.dumps(cfg))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[1, 2]", "must be a JSON object of PEFT settings, got list"),
        ('"LORA"', "must be a JSON object of PEFT settings, got str"),
        ("null", "got NoneType"),
        (
            '{"r":\n' + "[" * 100_000 + "]" * 100_000 + "}",
            "line 2, column 100: inv",
        ),
        ('{"r": ' + "9" * 5000 + "}", r"line 1, column 7: invalid JSON \(an integer"),
        ('{"r": 2, "x": "caf\udce9"}', "not UTF-8"),
    ],
)
def test_adapter_configs_that_are_not_settings_objects(adapter, text, match):
    folder, base, _ = adapter
    data = text.encode("utf-8", "surrogateescape")
    (folder / "adapter_config.json").write_bytes(data)
    with pytest.raises(FormatError, match=r"adapter_config\.json.*" + match):
        lora.load_adapter(folder, base)


def test_two_adapters_in_one_file_are_refused_not_mixed(tmp_path):
    """``lora_A.weight`` beside ``lora_A.other.weight``: one was silently dropped."""
    from safetensors.numpy import load_file, save_file

    base = make_params()
    lora.save_adapter(lora.apply(base, CFG, key=jax.random.key(0)), tmp_path)
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(file)
    a = next(k for k in tensors if k.endswith(".lora_A.weight"))
    other = a.replace(".lora_A.weight", ".lora_A.other.weight")
    save_file({**tensors, other: tensors[a] + 1}, file)
    with pytest.raises(CompatibilityError, match="two lora_A tensors") as e:
        lora.load_adapter(tmp_path, base)
    assert other in str(e.value)


@pytest.mark.parametrize("part", ["lora_A", "lora_B"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_adapter_tensor_with_nan_or_inf_is_refused_naming_it(tmp_path, part, value):
    """It loaded before, and every output of its module was NaN."""
    from safetensors.numpy import load_file, save_file

    base = make_params()
    lora.save_adapter(lora.apply(base, CFG, key=jax.random.key(0)), tmp_path)
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith(f".{part}.weight"))
    tensors[name] = tensors[name].copy()
    tensors[name].flat[-1] = value
    save_file(tensors, file)
    module = name.removeprefix("base_model.model.").removesuffix(f".{part}.weight")
    with pytest.raises(
        FormatError, match=rf"safetensors: {re.escape(module)}\.{part} "
    ):
        lora.load_adapter(tmp_path, base)


def test_saved_rank_patterns_still_load(tmp_path):
    base = make_params()
    lp = lora.apply(base, CFG, key=jax.random.key(1))
    up = LoRAConfig(rank=3, alpha=1.0, targets="up_proj")
    lp["model"]["layers"]["up_proj"] = lora.apply(base, up, key=jax.random.key(2))[
        "model"
    ]["layers"]["up_proj"]
    lora.save_adapter(lp, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["rank_pattern"] and cfg["alpha_pattern"]
    back = lora.load_adapter(tmp_path, base)["model"]["layers"]
    assert back["up_proj"]["weight"].rank != back["down_proj"]["weight"].rank


def test_one_huge_rank_among_small_ones_is_refused_before_padding(
    tmp_path, monkeypatch
):
    """Rank 512 on layer 0 of 32, rank 1 elsewhere: padding is 32x the file's bytes."""
    from safetensors.numpy import load_file, save_file

    from entrenar.lora import adapter_io

    n, big = 32, 512
    base = {"model": {"layers": {"up_proj": {"weight": jax.numpy.zeros((n, 2, 2))}}}}
    one = LoRAConfig(rank=1, alpha=1.0, targets="up_proj")
    lora.save_adapter(lora.apply(base, one, key=jax.random.key(0)), tmp_path)
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(file)
    stem = "base_model.model.model.layers.0.up_proj"
    tensors[f"{stem}.lora_A.weight"] = np.zeros((big, 2), np.float32)
    tensors[f"{stem}.lora_B.weight"] = np.zeros((2, big), np.float32)
    save_file(tensors, file)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["rank_pattern"] = {"model.layers.0.up_proj": big}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    padded = n * big * (2 + 2) * 4
    with pytest.raises(
        FormatError, match=rf"safetensors: .*ranks 1 to {big} on 32 of 32"
    ) as e:
        lora.load_adapter(tmp_path, base)
    assert f"{padded:,} bytes" in str(e.value)
    assert "model.layers.0.up_proj" in str(e.value)
    # the same file within the bound (a legitimate spread) loads, padded
    monkeypatch.setattr(adapter_io, "PAD_FILE_FACTOR", 64)
    w = lora.load_adapter(tmp_path, base)["model"]["layers"]["up_proj"]["weight"]
    assert w.a.shape == (n, big, 2)


def test_lora_config_targets_are_checked_like_adapter_patterns(deadline):
    with deadline(10), pytest.raises(ConfigError, match=r"LoRAConfig\.targets: .*ways"):
        LoRAConfig(targets=EVIL)
    with pytest.raises(ConfigError, match=r"alpha: must be a finite number, got nan"):
        LoRAConfig(alpha=float("nan"))
    with pytest.raises(ConfigError, match=r"rank: expected an integer, got True"):
        LoRAConfig(rank=True)
    # what people write still works
    cfg = LoRAConfig(
        targets=(r".*\.layers\.\d+\.self_attn\..*", r"mlp\.(up|down)_proj")
    )
    assert target_matches(cfg.targets[0], "model.layers.3.self_attn.q_proj", 2)


def test_a_long_module_name_is_checked_at_its_own_length(deadline):
    pattern = r".*a.*b.*c.*d"  # fine for 48-character names, not for 4,000
    check_pattern(pattern)
    with deadline(10), pytest.raises(ConfigError, match="4000-character module name"):
        target_matches(pattern, "x" * 4000, 2)


@given(
    key=st.lists(st.sampled_from(["q_proj", "0", "layers", "self_attn"]), min_size=1),
    module=st.lists(st.sampled_from(["q_proj", "0", "layers", "xq_proj"]), min_size=1),
)
def test_literal_keys_match_exactly_as_peft_regexes_do(key, module):
    k, m = re.escape(".".join(key)), ".".join(module)
    want = re.match(PEFT_KEY.replace("{}", k), m) is not None
    assert peft_key_matches(k, m) == want
