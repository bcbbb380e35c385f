"""llama.cpp GGUF files of every `LlamaConfig` family: names, metadata, round trips.

The names and keys are checked against the ``gguf`` package (llama.cpp's own Python
constants: ``MODEL_ARCH_NAMES``, ``MODEL_TENSORS``, ``TENSOR_NAMES``, ``Keys`` and
the Hugging Face -> GGUF ``TensorNameMap``), so a typo in entrenar's tables cannot
pass; each registered family's tiny model written and read back has the same config,
weights and logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import tempfile

import jax
import llama_cpp_cases as cases
import numpy as np
import pytest

from entrenar import io, nn, quant
from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.gguf_families import FAMILY_KEY, gguf_names, written_name
from entrenar.nn.rope_scaling import attention_factor, rope_inv_freq

gguf = pytest.importorskip("gguf")

FAMILIES = [
    a.name
    for a in nn.architectures()
    if a.config_class is nn.LlamaConfig
    and a.tiny is not None
    and written_name(a.name, a.gguf_name)
]
TOKENS = np.arange(11).reshape(1, 11) * 7 % 90  # (1, 11)
ARCH_BY_NAME = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}


def _tiny(family: str) -> tuple[nn.LlamaConfig, dict]:
    config = nn.architecture(family).tiny()
    config = dataclasses.replace(config, **cases.ROUTING.get(family, {}))
    return config, config.init(jax.random.key(3))


def _known_keys(name: str) -> set[str]:
    """Every ``{arch}.*`` key the gguf package defines, for llama.cpp name ``name``."""
    keys = set()
    for group in (gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope):
        for value in vars(group).values():
            if isinstance(value, str) and value.startswith("{arch}."):
                keys.add(value.replace("{arch}", name, 1))
    return keys


@pytest.mark.parametrize("family", FAMILIES)
def test_names_and_keys_are_llama_cpps(family, tmp_path):
    config, params = _tiny(family)
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, params)
    g = io.read_gguf(path)
    name = g.metadata["general.architecture"]
    assert name in ARCH_BY_NAME  # a llama.cpp architecture
    arch = ARCH_BY_NAME[name]
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    tmap = gguf.get_tensor_name_map(arch, config.num_layers)
    for hf, ours in gguf_names(config).items():
        want = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if not hf.endswith((".weight", ".bias")):  # gpt-oss's sinks: the converter
            want += ".weight"  # names them blk.N.attn_sinks.weight
        assert want == ours, hf
    for tensor in g.tensors:
        stem = tensor.rsplit(".", 1)[0]
        generic = stem.split(".", 2)
        if generic[0] == "blk":
            stem = f"blk.{{bid}}.{generic[2]}"
        assert stem in allowed, tensor
    known = _known_keys(name)
    for key in g.metadata:
        if not key.startswith(("general.", "tokenizer.", "entrenar.")):
            assert key in known, key


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_a_family_round_trips_through_gguf(family, kind, tmp_path):
    config, params = _tiny(family)
    if kind != "F32" and config.moe_intermediate_size:  # whole Q8_0 blocks a row
        shared = 64 if config.shared_expert_intermediate_size else 0
        config = dataclasses.replace(
            config, moe_intermediate_size=32, shared_expert_intermediate_size=shared
        )
        params = config.init(jax.random.key(3))
    if kind != "F32" and config.shared_mlp_intermediate_size:  # Granite's shared
        config = dataclasses.replace(config, shared_mlp_intermediate_size=32)
        params = config.init(jax.random.key(3))
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, params, tensor_type=kind)
    back, loaded, _ = io.load_llama_gguf(path)
    assert back == config
    want = config.apply(params, TOKENS)
    got = back.apply(loaded, TOKENS)
    if kind == "F32":
        jax.tree.map(np.testing.assert_array_equal, loaded, params)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.05)
    assert io.file_architecture(str(path)) == family


def test_the_switch_names_match_llama_cpps_for_gemma_and_phi3():
    """Families not registered yet still map their modules as llama.cpp does."""
    base = nn.architecture("qwen3").tiny()
    gemma = dataclasses.replace(base, sandwich_norms=True, tie_word_embeddings=False)
    phi3 = dataclasses.replace(
        base, qk_norm=False, fused_qkv=True, fused_gate_up=True, attention_bias=False,
        attention_out_bias=False,
    )  # fmt: skip
    for config, arch in ((gemma, "GEMMA3"), (phi3, "PHI3")):
        tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), 2)
        for hf, ours in gguf_names(config).items():
            if ".bias" in hf and arch == "GEMMA3":
                continue  # Gemma has no biases; the map has no names for them
            assert tmap.get_name(hf, try_suffixes=(".weight", ".bias")) == ours, hf


def test_qk_rows_are_permuted_for_llama_only(tmp_path):
    for family in ("llama", "qwen2"):
        config, params = _tiny(family)
        path = tmp_path / f"{family}.gguf"
        io.save_llama_gguf(path, config, params)
        g = io.read_gguf(path)
        q = np.asarray(params["model"]["layers"]["self_attn"]["q_proj"]["weight"][0])
        qb = np.asarray(params["model"]["layers"]["self_attn"]["q_proj"]["bias"][0])
        stored, stored_b = (
            g.tensor("blk.0.attn_q.weight"),
            g.tensor("blk.0.attn_q.bias"),
        )
        if family == "llama":
            q = io.permute_qk(q, config.num_heads)
            qb = io.permute_qk(qb[:, None], config.num_heads)[:, 0]
        np.testing.assert_array_equal(stored, q)
        np.testing.assert_array_equal(stored_b, qb)


def test_llama3_scaling_is_written_as_rope_freqs(tmp_path):
    config, params = _tiny("llama")
    assert config.rope_type == "llama3"
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, params)
    g = io.read_gguf(path)
    divisors = g.tensor("rope_freqs.weight")
    assert divisors.shape == (config.hd // 2,)
    assert divisors[0] == 1.0 and divisors[-1] == pytest.approx(config.rope_factor)
    # Read without entrenar's own key, as a file llama.cpp's converter wrote: the
    # divisors stand for the scaling and give the same logits.
    fields = {k: f for k, f in g.fields.items() if k != FAMILY_KEY}
    plain = tmp_path / "plain.gguf"
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    io.write_gguf(plain, fields, tensors)
    back, loaded, _ = io.load_llama_gguf(plain)
    assert back.rope_type == "default" and back.rope_freq_divisors is not None
    np.testing.assert_allclose(
        np.asarray(back.apply(loaded, TOKENS)),
        np.asarray(config.apply(params, TOKENS)),
        atol=1e-4,
    )


# ------------------------------------------------------------------ yarn
def _llama_cpp_yarn_scale(meta: dict, arch: str) -> float:
    """The factor llama.cpp scales yarn's ``cos`` and ``sin`` by, as it computes it.

    llama_context's constructor (src/llama-context.cpp, ``yarn_ext_factor`` 1 for
    yarn): ``get_mscale(1/freq_scale) / (1 + 0.1 ln(1/freq_scale))`` times
    ``rope.scaling.attn_factor`` (default 1); ggml's ``rope_yarn`` then multiplies by
    ``1 + 0.1 ln(1/freq_scale)``. No llama.cpp architecture entrenar writes reads
    ``rope.scaling.yarn_attn_factor``.
    """
    freq_scale = 1.0 / meta[f"{arch}.rope.scaling.factor"]
    factor = 1.0 / freq_scale
    get_mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    attn = get_mscale * (1.0 / (1.0 + 0.1 * math.log(factor)))
    attn *= meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)
    return attn * (1.0 + 0.1 * math.log(1.0 / freq_scale))


def _yarn(family: str, attention: float | None) -> nn.LlamaConfig:
    return dataclasses.replace(
        nn.architecture(family).tiny(),
        rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=32,
        rope_attention_factor=attention, sliding_window=None, layer_types=None,
    )  # fmt: skip


def _transformers_yarn(family: str, config: nn.LlamaConfig):
    """The yarn inverse frequencies and attention factor transformers computes."""
    transformers = pytest.importorskip("transformers")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    hf = nn.architecture(family).to_hf(config)
    inv, scale = rope_utils.ROPE_INIT_FUNCTIONS["yarn"](
        transformers.AutoConfig.for_model(**hf), None
    )
    return inv.numpy(), scale


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("attention", [None, 0.8, 1.3])
def test_yarn_attention_factor_is_written_for_llama_cpps_rule(
    family, attention, tmp_path
):
    """llama.cpp multiplies ``attn_factor`` by its own ``0.1 ln(factor) + 1``.

    Written as config.json's ``attention_factor`` (before), llama.cpp scaled cos and
    sin by 1.14 x 0.8 = 0.91 where transformers scales them by 0.8.
    """
    config = _yarn(family, attention)
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, config.init(jax.random.key(0)))
    meta = io.read_gguf(path).metadata
    name = meta["general.architecture"]
    _, want = _transformers_yarn(family, config)
    assert _llama_cpp_yarn_scale(meta, name) == pytest.approx(want, rel=1e-6)
    if attention is not None:  # as llama.cpp's converter keeps config.json's
        key = f"{name}.rope.scaling.yarn_attn_factor"
        assert meta[key] == pytest.approx(attention, rel=1e-6)


@pytest.mark.parametrize("keep", ["attn_factor", "yarn_attn_factor", "both"])
def test_a_yarn_file_reads_to_transformers_attention_factor(keep, tmp_path):
    """A yarn file without ``entrenar.family`` reads as transformers computes.

    ``rope.scaling.attn_factor`` counts as llama.cpp applies it (x ``0.1 ln(factor)
    + 1``), else ``yarn_attn_factor``, where llama.cpp's converter puts config.json's
    ``attention_factor``. Before, the converter's key was not read (cos and sin
    scaled by 1.14 for 0.8) and ``attn_factor`` was taken as the whole factor.
    """
    config = _yarn("qwen2", 0.8)
    path = tmp_path / "m.gguf"
    params = config.init(jax.random.key(0))
    io.save_llama_gguf(path, config, params)
    drop = {"attn_factor": "yarn_attn_factor", "yarn_attn_factor": "attn_factor"}
    gone = [FAMILY_KEY] + [f"qwen2.rope.scaling.{drop[k]}" for k in drop if k == keep]
    back, loaded, _ = io.load_llama_gguf(
        _rewrite(path, tmp_path / "x.gguf", None, gone)
    )
    want_inv, want = _transformers_yarn("qwen2", config)
    assert attention_factor(back) == pytest.approx(want, rel=1e-6)
    inv = rope_inv_freq(back, jax.numpy.arange(4), jax.numpy.float32)
    np.testing.assert_allclose(np.asarray(inv), want_inv, rtol=2e-6)
    np.testing.assert_allclose(
        np.asarray(back.apply(loaded, TOKENS)),
        np.asarray(config.apply(params, TOKENS)),
        atol=1e-5,
    )


# ------------------------------------------------------------------ the converter
CONVERTED = cases.ROOT / "tests/data/llama_cpp_converted"


CONVERTED_CASES = sorted(
    json.loads((CONVERTED / "reference.json").read_text())["cases"]
)
FAMILY_CONVERTED = [c for c in CONVERTED_CASES if c in FAMILIES]


@pytest.mark.parametrize("case", CONVERTED_CASES)
def test_a_file_llama_cpps_converter_wrote_reads_to_transformers(case):
    """llama.cpp's converter's file of a tiny model reads to transformers' numbers.

    The F16 GGUF convert_hf_to_gguf.py made of a tiny transformers model
    (tests/oracles/make_converter_reference.py) gives that model's logits and rotary
    scaling: Qwen2's yarn ``attention_factor`` 0.8 is in ``yarn_attn_factor`` (before:
    not read, 0.015 off the logits); Phi-3 without a window (Phi-4's config) has
    ``sliding_window = 0`` (before: refused, 'want an int > 0').
    """
    record = json.loads((CONVERTED / "reference.json").read_text())
    path = CONVERTED / f"{case}.gguf"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == record["cases"][case]["sha256"]
    with np.load(CONVERTED / "reference.npz") as z:
        want = z[case]
    config, params, _ = io.load_llama_gguf(path)
    hf = record["cases"][case]["config.json"]
    from_hf = nn.LlamaConfig.from_hf_config(hf)
    assert config.architecture == from_hf.architecture  # olmo3 in olmo2's name
    assert config.sliding_window == from_hf.sliding_window
    factor = attention_factor(from_hf)  # None: no scaling of cos and sin
    assert attention_factor(config) == (factor and pytest.approx(factor, 1e-6))
    positions = jax.numpy.arange(len(record["how"]["tokens"][0]))
    inv = [rope_inv_freq(c, positions, jax.numpy.float32) for c in (config, from_hf)]
    if inv != [None, None]:  # None: unscaled rotary
        np.testing.assert_allclose(np.asarray(inv[0]), np.asarray(inv[1]), rtol=1e-6)
    got = np.asarray(config.apply(params, np.asarray(record["how"]["tokens"])))
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("case", FAMILY_CONVERTED)
def test_entrenar_writes_the_converters_tensors_and_keys(case, tmp_path):
    """The converter's file read and written again by entrenar is the converter's.

    Same tensor names, shapes and values (q/k rows, Gemma's ``1 + w`` norms, ...)
    and every ``{arch}.*`` key the converter wrote, with its value; entrenar may
    add keys (llama.cpp's defaults, written out) and ``entrenar.family``.
    """
    config, params, _ = io.load_llama_gguf(CONVERTED / f"{case}.gguf")
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, params, tensor_type="F16")
    theirs, ours = io.read_gguf(CONVERTED / f"{case}.gguf"), io.read_gguf(path)
    assert set(ours.tensors) == set(theirs.tensors)
    for name in theirs.tensors:
        want = theirs.tensor(name).astype(np.float32)
        np.testing.assert_array_equal(ours.tensor(name).astype(np.float32), want, name)
    name = theirs.metadata["general.architecture"]
    assert ours.metadata["general.architecture"] == name
    for key, value in theirs.metadata.items():
        if key.startswith(f"{name}.") and isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value, rel=1e-6), key
        elif key.startswith(f"{name}."):
            assert ours.metadata[key] == value, key
    assert io.load_llama_gguf(path)[0] == config


def test_mistral_is_written_as_llama_and_read_back_as_mistral(tmp_path):
    config, params = _tiny("mistral")
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, params)
    g = io.read_gguf(path)
    assert g.metadata["general.architecture"] == "llama"
    assert json.loads(g.metadata[FAMILY_KEY])["architecture"] == "mistral"
    assert io.load_llama_gguf(path)[0].architecture == "mistral"


# ------------------------------------------------------------------ hostile files
def _rewrite(src, dst, fields=None, drop=()):
    g = io.read_gguf(src)
    out = {k: f for k, f in g.fields.items() if k not in drop} | (fields or {})
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    io.write_gguf(dst, out, tensors)
    return dst


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory):
    config, params = _tiny("qwen2")
    path = tmp_path_factory.mktemp("gguf") / "q.gguf"
    io.save_llama_gguf(path, config, params)
    return path


S = io.GGUFValueType.STRING


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"general.architecture": io.GGUFField("mamba", S)}, UnsupportedError,
         r"q\.gguf: general\.architecture 'mamba' is not supported.*qwen2"),
        ({"qwen2.rope.scaling.type": io.GGUFField("mrope", S)}, UnsupportedError,
         r"'qwen2\.rope\.scaling\.type' = 'mrope'"),
        ({FAMILY_KEY: io.GGUFField('{"vocab_size": 3}', S)}, FormatError,
         r"entrenar\.family"),
        ({FAMILY_KEY: io.GGUFField('{"architecture": "qwen3"}', S)}, FormatError,
         r"family 'qwen3'.*'qwen2'"),
        ({FAMILY_KEY: io.GGUFField('{"architecture": "mamba"}', S)}, FormatError,
         r"q\.gguf: .*family 'mamba'.*'qwen2'"),
        ({FAMILY_KEY: io.GGUFField("{not json", S)}, FormatError,
         r"q\.gguf: metadata 'entrenar\.family' must be a JSON object"),
        ({FAMILY_KEY: io.GGUFField("[" * 5000 + "]" * 5000, S)}, FormatError,
         r"must be a JSON object"),
        ({"qwen2.attention.sliding_window": io.GGUFField("4", S)},
         FormatError, r"sliding_window.*want an int > 0"),
    ],
)  # fmt: skip
def test_bad_metadata_names_the_file_and_the_key(
    qwen_file, tmp_path, fields, error, match
):
    path = _rewrite(qwen_file, tmp_path / "q.gguf", fields)
    with pytest.raises(error, match=match):
        io.load_llama_gguf(path)


def test_a_tensor_of_another_family_is_refused(qwen_file, tmp_path):
    g = io.read_gguf(qwen_file)
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    raw = g.raw("output_norm.weight")
    tensors["blk.0.post_ffw_norm.weight"] = io.GGUFTensor(raw, (32,), 0)
    io.write_gguf(tmp_path / "x.gguf", dict(g.fields), tensors)
    with pytest.raises(FormatError, match=r"unexpected tensors.*post_ffw_norm.*qwen2"):
        io.load_llama_gguf(tmp_path / "x.gguf")


# ------------------------------------------------------------------ llama.cpp
@pytest.fixture(scope="module", params=["recorded", "live"])
def families_cpp(request):
    """llama.cpp's logits for each family's file: recorded, or computed now."""
    if request.param == "recorded":
        return cases.load_families(cases.RECORDED)
    out = cases.Path(tempfile.mkdtemp(prefix="llama_cpp_families_"))
    try:
        cases.run_script(out, "--only-families")
        return cases.load_families(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("family", cases.family_cases())
def test_each_family_written_runs_in_llama_cpp(family, families_cpp, tmp_path):
    record, arrays = families_cpp
    if family not in record["families"]:
        pytest.skip(
            f"no llama.cpp reference for {family}: rerun tests/oracles/"
            "make_llama_cpp_reference.py --only-families"
        )
    config = cases.family_config(family)
    path = tmp_path / f"{family}.gguf"
    io.save_llama_gguf(
        path, config, cases.family_params(config), source=io.smollm2_path(),
        **cases.write_types(family),
    )  # fmt: skip
    back, params, _ = io.load_llama_gguf(path)
    assert back == config
    ours = np.asarray(back.apply(params, np.asarray([cases.TINY_IDS]))[0])  # (T, V)
    # F32 weights and KV cache: llama.cpp agrees to rounding, but for GeGLU, which
    # ggml computes through a float16 table of GELU (about 1e-3 of the logits),
    # and for MXFP4 experts, whose products ggml takes with the activations
    # rounded to Q8_0 (8 bits).
    scale = max(1.0, float(np.abs(arrays[f"{family}_top_logits"]).max()))
    tol = (1e-5 if config.hidden_act == "silu" else 2e-3) * scale
    if family in cases.WRITE_TYPES:
        tol = 1e-2 * scale
    np.testing.assert_allclose(
        ours[:, :: cases.TINY_COLUMN_STEP], arrays[f"{family}_logits"], atol=tol
    )
    top = arrays[f"{family}_top_ids"]  # (T, 8): llama.cpp's best tokens
    mine = np.take_along_axis(ours, top, axis=-1)
    np.testing.assert_allclose(mine, arrays[f"{family}_top_logits"], atol=tol)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == record["families"][family]["sha256"], (
        f"{path.name} differs from the file llama.cpp ran; if the writer changed on "
        "purpose, rerun tests/oracles/make_llama_cpp_reference.py --only-families"
    )


def test_a_tokenizer_only_source_gives_the_file_its_tokenizer(tmp_path):
    """A source GGUF whose general.architecture is "tokenizer" keeps tokenizer.*."""
    tok = io.read_gguf(cases.ROOT / "examples/data/number_words/tokenizer.gguf")
    assert tok.fields["general.architecture"].value == "tokenizer"
    config = dataclasses.replace(nn.architecture("qwen2").tiny(), vocab_size=320)
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, config.init(jax.random.key(0)), source=tok)
    fields = io.read_gguf(path).fields
    assert fields["general.architecture"].value == "qwen2"
    for key, field in tok.fields.items():
        if key.startswith("tokenizer."):
            assert fields[key].value == field.value, key


def test_an_untied_gemma_is_refused_for_llama_cpps_tied_graph(tmp_path):
    config = dataclasses.replace(
        nn.architecture("gemma").tiny(), tie_word_embeddings=False
    )
    with pytest.raises(UnsupportedError, match="gemma ties its output head"):
        io.save_llama_gguf(tmp_path / "m.gguf", config, config.init(jax.random.key(0)))


def test_interleaved_rotary_is_refused_and_families_without_gguf_too(tmp_path):
    """ERNIE 4.5's pairs: entrenar writes llama.cpp's q/k rows half-split only."""
    config = dataclasses.replace(nn.architecture("llama").tiny(), rope_interleave=True)
    with pytest.raises(UnsupportedError, match="rope_interleave"):
        io.save_llama_gguf(tmp_path / "m.gguf", config, config.init(jax.random.key(0)))
    ungated = dataclasses.replace(config, rope_interleave=False, ungated_mlp=True)
    with pytest.raises(UnsupportedError, match="needs ffn_gate"):
        io.save_llama_gguf(tmp_path / "m.gguf", ungated, config.init(jax.random.key(0)))
    seed = dataclasses.replace(nn.architecture("seed_oss").tiny(), mlp_bias=True)
    with pytest.raises(UnsupportedError, match="seed_oss loads no mlp bias"):
        io.save_llama_gguf(tmp_path / "m.gguf", seed, seed.init(jax.random.key(0)))
    ernie = dataclasses.replace(nn.architecture("ernie4_5").tiny(), mlp_bias=True)
    with pytest.raises(UnsupportedError, match="ernie4_5 loads no mlp bias"):
        io.save_llama_gguf(tmp_path / "m.gguf", ernie, ernie.init(jax.random.key(0)))
    arcee = dataclasses.replace(nn.architecture("arcee").tiny(), mlp_bias=True)
    with pytest.raises(UnsupportedError, match="arcee loads no mlp bias"):
        io.save_llama_gguf(tmp_path / "m.gguf", arcee, arcee.init(jax.random.key(0)))
    glm = nn.architecture("glm").tiny()  # llama.cpp's chatglm: not written
    with pytest.raises(UnsupportedError, match=r"no llama\.cpp GGUF form"):
        io.save_llama_gguf(tmp_path / "m.gguf", glm, glm.init(jax.random.key(0)))


def test_exaone4_layouts_llama_cpp_computes_otherwise_are_refused(tmp_path):
    """llama.cpp's exaone4 slides only at 64 layers, and then rotates only those."""
    tiny = dataclasses.replace(  # 2 layers: one sliding, one NoPE
        nn.architecture("exaone4").tiny(), hidden_size=64
    )
    with pytest.raises(UnsupportedError, match="sliding layers only at 64 layers"):
        io.save_llama_gguf(tmp_path / "m.gguf", tiny, tiny.init(jax.random.key(0)))
    window = dataclasses.replace(  # a window, every layer global: all NoPE
        tiny, layer_types=None, nope_layers=(True, True)
    )
    with pytest.raises(UnsupportedError, match=r"nope_layers=\(True, True\)"):
        io.save_llama_gguf(tmp_path / "m.gguf", window, tiny.init(jax.random.key(0)))
    big = dataclasses.replace(tiny, num_layers=64, **cases.ROUTING["exaone4"])
    with pytest.raises(UnsupportedError, match=r"as EXAONE 4\.0 32B"):
        io.save_llama_gguf(tmp_path / "m.gguf", big, big.init(jax.random.key(0)))


def test_an_exaone4_window_llama_cpp_ignores_is_read_as_it_runs(tmp_path):
    """Below 64 layers llama.cpp's exaone4 ignores the window keys (warned)."""
    config = dataclasses.replace(
        nn.architecture("exaone4").tiny(), **cases.ROUTING["exaone4"]
    )
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, config.init(jax.random.key(0)))
    g = io.read_gguf(path)
    fields = {k: f for k, f in g.fields.items() if k != FAMILY_KEY}
    window = type(g.fields["exaone4.block_count"])  # GGUFField
    uint, array, boolean = (
        io.GGUFValueType.UINT32, io.GGUFValueType.ARRAY, io.GGUFValueType.BOOL
    )  # fmt: skip
    fields["exaone4.attention.sliding_window"] = window(4, uint)
    fields["exaone4.attention.sliding_window_pattern"] = window(
        [True, False], array, boolean
    )
    windowed = tmp_path / "w.gguf"
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    io.write_gguf(windowed, fields, tensors)
    with pytest.warns(UserWarning, match="slides only at 64 layers"):
        back, _, _ = io.load_llama_gguf(windowed)
    assert (back.sliding_window, back.layer_types, back.nope_layers) == (None,) * 3


def test_a_mistral3_file_without_the_query_scale_is_a_mistral(tmp_path):
    """llama.cpp's converter writes Mistral Small 3.1/3.2's text model as mistral3."""
    tiny = nn.architecture("ministral3").tiny()
    params = tiny.init(jax.random.key(0))
    unscaled = dataclasses.replace(tiny, query_scale_beta=None, query_scale_length=None)
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, unscaled, params)
    assert io.load_llama_gguf(path)[0] == unscaled  # entrenar.family names it
    g = io.read_gguf(path)
    fields = {k: f for k, f in g.fields.items() if k != FAMILY_KEY}
    plain = tmp_path / "plain.gguf"
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    io.write_gguf(plain, fields, tensors)
    back = io.load_llama_gguf(plain)[0]
    assert back == dataclasses.replace(unscaled, architecture="mistral")


def test_ministral3_variants_llama_cpp_lacks_are_refused(tmp_path):
    """llama.cpp's mistral3 has no window; one period for yarn and the scale."""
    tiny = nn.architecture("ministral3").tiny()
    params = tiny.init(jax.random.key(0))
    window = dataclasses.replace(tiny, sliding_window=4)
    with pytest.raises(UnsupportedError, match="mistral3 has no sliding window"):
        io.save_llama_gguf(tmp_path / "m.gguf", window, params)
    period = dataclasses.replace(tiny, query_scale_length=8)
    with pytest.raises(UnsupportedError, match="query_scale_length 8"):
        io.save_llama_gguf(tmp_path / "m.gguf", period, params)
    llama = dataclasses.replace(tiny, architecture="llama")
    with pytest.raises(UnsupportedError, match="llama has no query scale"):
        io.save_llama_gguf(tmp_path / "m.gguf", llama, params)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0"])
@pytest.mark.parametrize(
    "config",
    [
        dataclasses.replace(
            nn.architecture("exaone4").tiny(), hidden_size=64, num_layers=64,
            **cases.EXAONE4_SWA,
        ),
        dataclasses.replace(
            nn.architecture("ministral3").tiny(), rope_attention_factor=1.0
        ),  # Ministral 3's mscale = mscale_all_dim: yarn_log_multiplier 1
        dataclasses.replace(
            nn.architecture("ministral3").tiny(), rope_type="default",
            rope_factor=1.0, rope_original_max_position_embeddings=None,
        ),  # the scale's period in original_context_length without yarn
    ],
    ids=["exaone4_swa", "ministral3_mscale", "ministral3_unscaled"],
)  # fmt: skip
def test_exaone4_and_ministral3_variants_round_trip(config, kind, tmp_path):
    """Written in each type and read back: each matrix is its stored rounding.

    Bit for bit: F32 as it was, F16/BF16 rounded, Q8_0 as `entrenar.quant`
    quantizes and dequantizes it (norms stay F32); written again, the same bytes.
    """
    params = config.init(jax.random.key(5))
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params, tensor_type=kind)
    back, loaded, _ = io.load_llama_gguf(path)
    assert back == config
    assert io.file_architecture(str(path)) == config.architecture

    def stored(w):
        a = np.asarray(w, np.float32)
        if kind in ("F16", "BF16"):
            dt = np.float16 if kind == "F16" else jax.numpy.bfloat16
            return np.asarray(a.astype(dt), np.float32)
        if kind == "Q8_0":
            return np.asarray(quant.dequantize(quant.quantize(a, "q8_0"), np.float32))
        return a

    def check(kp, want, got):
        name = jax.tree_util.keystr(kp)
        want = np.asarray(want, np.float32)
        if "embed" in name or "lm_head" in name:
            want = stored(want)
        elif want.ndim == 3:  # (L, out, in) a layer at a time
            want = np.stack([stored(w) for w in want])
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)

    jax.tree_util.tree_map_with_path(check, params, loaded)
    again = tmp_path / "b.gguf"
    io.save_llama_gguf(again, back, loaded, source=path, tensor_type=kind)
    assert again.read_bytes() == path.read_bytes()
