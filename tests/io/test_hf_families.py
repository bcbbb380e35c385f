"""Hugging Face folders of every registered family: read, written, and their tokenizers.

transformers is the oracle: a tiny random model of each family (``arch.tiny()``, every
switch on) saved by ``save_pretrained`` in small shards loads into entrenar with the
same weights and logits; the folder entrenar exports loads with
``AutoModelForCausalLM`` and ``AutoTokenizer`` to the same weights, logits and ids;
each family's tiny tokenizer (tests/io/hf_cases.py) gives ``AutoTokenizer``'s ids and
``apply_chat_template``'s text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import hf_cases
import jax
import numpy as np
import pytest

from entrenar import data, io, nn
from entrenar.data.formatting import special_texts
from entrenar.errors import FormatError, UnsupportedError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = [
    a.name
    for a in nn.architectures()
    if a.tiny is not None and a.to_hf is not None and a.from_hf is not None
]
TOKENS = np.arange(11).reshape(1, 11) * 7 % 90  # (1, 11), longer than the windows


def _hf_model(family: str, folder, *, shard: str = "20KB"):
    """A random transformers model of ``family``'s tiny config, saved in shards."""
    arch = nn.architecture(family)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(arch.to_hf(arch.tiny())))
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder, max_shard_size=shard)
    return model


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_folder_loads_with_its_weights_and_logits(family, tmp_path):
    model = _hf_model(family, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # sharded
    info, params = io.load_hf_folder(tmp_path / "hf")
    assert info.architecture.name == family
    assert info.config == nn.architecture(family).tiny()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if info.architecture.from_hf_tensors is not None:  # MoE: fused in memory
        state = info.architecture.from_hf_tensors(state, info.config)
    for name, value in nn.to_hf_names(params).items():
        np.testing.assert_array_equal(np.asarray(value), state[name], err_msg=name)
    got = np.asarray(info.config.apply(params, TOKENS))
    np.testing.assert_allclose(got, _logits(model, TOKENS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_exported_folder_loads_in_transformers(family, tmp_path):
    config = nn.architecture(family).tiny()
    params = config.init(jax.random.key(1))
    hf_cases.write_tokenizer(tmp_path / "tok", family)
    tok = data.load_fast_tokenizer(tmp_path / "tok")
    out = io.save_hf_folder(
        tmp_path / "out", config, params, tokenizer=tok, max_shard_bytes=20_000
    )
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == nn.architecture(family).hf_class
    want = np.asarray(config.apply(params, TOKENS))
    np.testing.assert_allclose(_logits(model, TOKENS), want, atol=1e-4, rtol=1e-4)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in hf_cases.TEXTS[:1] + hf_cases.TEXTS[2:]:
        assert auto(text)["input_ids"] == tok.encode(text), text
    rendered = auto.apply_chat_template(
        hf_cases.MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert rendered == data.render_chat(
        hf_cases.MESSAGES, tok.chat_template, add_generation_prompt=True,
        **special_texts(tok),
    )  # fmt: skip
    back, _ = io.load_hf_folder(out)
    assert back.config == config and back.eos_ids == tuple(
        [tok.eos_id, *(i for i in tok.stop_ids if i != tok.eos_id)]
    )


@pytest.mark.parametrize("family", sorted(set(hf_cases.FAMILY_STYLE)))
def test_each_family_tokenizer_matches_auto_tokenizer(family, tmp_path):
    style = hf_cases.write_tokenizer(tmp_path, family)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = data.load_fast_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(tok, io.HFTokenizer)
    raw = __import__("tokenizers").Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in hf_cases.TEXTS:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids, text  # the file's own pipeline
        # transformers 5's LlamaTokenizer rebuilds a Metaspace pipeline that merges
        # a run of leading spaces; elsewhere it reads the file as it is.
        if not (style["kind"] == "sp" and style["prepend"] and text.startswith("  ")):
            assert ids == auto(text)["input_ids"], text
        assert tok.decode(ids) == auto.decode(ids, skip_special_tokens=True)
    assert tok.eos_id == auto.eos_token_id and tok.bos_id == auto.bos_token_id
    for gen in (False, True):
        want = auto.apply_chat_template(
            hf_cases.MESSAGES[: 2 if gen else 3], tokenize=False,
            add_generation_prompt=gen,
        )  # fmt: skip
        got = data.render_chat(
            hf_cases.MESSAGES[: 2 if gen else 3], tok.chat_template,
            add_generation_prompt=gen, **special_texts(tok),
        )  # fmt: skip
        assert got == want
    specials = style["specials"]
    text = specials[-1] + "Hello" + specials[-1]
    ids = tok.encode(text, add_bos=False, special=True)
    if style["kind"] == "sp" and style["prepend"]:  # as above: the file's own
        assert ids == raw.encode(text, add_special_tokens=False).ids
    else:
        assert ids == auto(text, add_special_tokens=False)["input_ids"]
    assert tok.token_types[ids[0]] == 3
    assert len(tok.encode(specials[-1], add_bos=False)) > 1  # plain text unless asked


def test_token_bytes_add_up_for_byte_level_and_byte_fallback(tmp_path):
    for family in ("qwen2", "gemma2"):
        hf_cases.write_tokenizer(tmp_path / family, family)
        tok = io.HFTokenizer.from_folder(tmp_path / family)
        text = "Hello world, café 😀 zqxj"
        ids = tok.encode(text, add_bos=False)
        assert b"".join(tok.token_bytes[i] for i in ids) == text.encode()


def test_the_first_chat_template_file_wins(tmp_path):
    hf_cases.write_tokenizer(tmp_path, "qwen2")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert io.HFTokenizer.from_folder(tmp_path).chat_template.startswith("{{ mes")


# ------------------------------------------------------------------ hostile folders
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "m"
    _hf_model("llama", path, shard="8KB")
    return path


def _copy(folder, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(folder, out)
    return out


def test_an_unknown_model_type_names_the_file_and_the_types(folder, tmp_path):
    m = _copy(folder, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps(cfg | {"model_type": "bert"}))
    with pytest.raises(UnsupportedError, match=r"config\.json.*'bert'.*llama"):
        io.load_hf_folder(m)


def test_a_rope_type_the_family_cannot_honour_is_unsupported(folder, tmp_path):
    m = _copy(folder, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "mrope", "factor": 2.0}
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match=r"config\.json.*mrope"):
        io.read_hf_folder(m)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda wm: {k: "../x.safetensors" for k in wm}, "plain file name"),
        (lambda wm: {k: "gone.safetensors" for k in wm}, "gone.safetensors.*missing"),
        (lambda wm: dict(wm, **{"model.extra.weight": next(iter(wm.values()))}),
         "does not hold"),
        (lambda wm: [], "weight_map"),
    ],
)  # fmt: skip
def test_a_bad_index_is_refused_before_any_tensor_is_read(
    folder, tmp_path, edit, match
):
    m = _copy(folder, tmp_path)
    index = m / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = edit(doc["weight_map"])
    index.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=match) as e:
        io.load_hf_folder(m)
    assert "index.json" in str(e.value)


def test_a_missing_or_misshapen_tensor_names_the_folder(folder, tmp_path):
    m = _copy(folder, tmp_path)
    index = m / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    shard = doc["weight_map"].pop("model.norm.weight")
    tensors, _ = io.read_safetensors(m / shard)
    kept = {k: np.array(v) for k, v in tensors.items() if k != "model.norm.weight"}
    io.save_safetensors(kept, m / shard, {"format": "pt"})
    index.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"m: missing parameter 'model\.norm"):
        io.load_hf_folder(m)
    kept["model.norm.weight"] = np.zeros(3, np.float32)
    io.save_safetensors(kept, m / shard, {"format": "pt"})
    doc["weight_map"]["model.norm.weight"] = shard
    index.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"m: parameter 'model\.norm.*shape"):
        io.load_hf_folder(m)


def test_bad_tokenizer_files_name_the_file_and_the_field(tmp_path):
    hf_cases.write_tokenizer(tmp_path, "qwen2")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(cfg | {"eos_token": "<|nope|>"})
    )
    with pytest.raises(FormatError, match=r"tokenizer_config\.json: eos_token"):
        io.HFTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(FormatError, match=r"generation_config\.json.*eos_token_id"):
        io.HFTokenizer.from_folder(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    with pytest.raises(FormatError, match=r"tokenizer\.json: tokenizers cannot"):
        io.HFTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("[1, 2")
    with pytest.raises(FormatError, match=r"tokenizer\.json line 1"):
        io.HFTokenizer.from_folder(tmp_path)


# ------------------------------------------------------------------ hostile config.json
@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """The folder entrenar wrote for each family's tiny config, by family."""
    out = {}
    for family in ("deepseek_v3", "gpt_oss", "ministral3", "glm4_moe", "gemma2"):
        config = nn.architecture(family).tiny()
        folder = tmp_path_factory.mktemp(family)
        io.save_hf_folder(folder, config, config.init(jax.random.key(0)))
        out[family] = folder
    return out


@pytest.mark.parametrize(
    ("family", "key", "value", "match"),
    [
        # each built a name per expert or layer (minutes, gigabytes) before any
        # tensor's shape was compared
        ("deepseek_v3", "n_routed_experts", 10**9, "experts = 10+: want at most 65536"),
        ("deepseek_v3", "num_hidden_layers", 10**9, "layers = 10+: want at most 4096"),
        ("glm4_moe", "hidden_size", 10**12, "size = 10+: want at most 2147483647"),
        # Gemma 2's reader built a list per layer first (10^8: 7 s, 950 MB)
        ("gemma2", "num_hidden_layers", 10**8, "num_hidden_layers = 10+: want at most"),
        # refused deep inside under entrenar's names, or as a shape of -12 rows
        ("deepseek_v3", "num_hidden_layers", -1, "num_hidden_layers = -1: want a"),
        ("glm4_moe", "n_shared_experts", -1, "n_shared_experts = -1: want a count"),
        # each loaded: a rotary scaled for a negative context (DeepSeek's forward
        # pass then raised a bare "math domain error")
        ("gpt_oss", "max_position_embeddings", -1, "max_position_embeddings = -1"),
        (
            "deepseek_v3",
            "rope_scaling.original_max_position_embeddings",
            -8,
            "rope_scaling.original_max_position_embeddings = -8: want",
        ),
        ("glm4_moe", "num_nextn_predict_layers", -2, "predict_layers = -2: want"),
        # each loaded, and its logits were NaN
        ("gpt_oss", "rope_scaling.beta_fast", math.nan, "rope_beta_fast = nan"),
        ("ministral3", "rope_parameters.llama_4_scaling_beta", math.inf, "= inf"),
    ],
)
def test_a_config_json_with_impossible_numbers_is_refused_before_loading(
    tiny_folders, tmp_path, family, key, value, match, deadline
):
    folder = tmp_path / family
    shutil.copytree(tiny_folders[family], folder)
    config = json.loads((folder / "config.json").read_text())
    *path, last = key.split(".")
    node = config
    for k in path:
        node = node[k]
    node[last] = value
    (folder / "config.json").write_text(json.dumps(config))
    with deadline(20), pytest.raises(FormatError, match=r"config\.json: .*" + match):
        io.load_hf_folder(folder)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_nextn_predict_layers", -1), ("rope_original_max_position_embeddings", -3)],
)
def test_a_config_with_a_negative_count_is_refused_by_field(field, value):
    # the fields a config.json key outside HF_COUNTS could fill: none is negative
    config = dataclasses.replace(
        nn.architecture("deepseek_v3").tiny(), **{field: value}
    )
    with pytest.raises(FormatError, match=rf"c\.json: DeepseekConfig\.{field} = "):
        io.hf_folder.check_config_values(config, "c.json")
