"""8-bit decode activations chosen per call: `nn.generate`, `ChatModel`, the CLI.

``decode_activations="int8"`` (``--decode-activations int8``) must give the tokens
that the process setting ``nn.matvec.activations("int8")`` gives, and ``"float32"``
those of the float32 setting, whatever the process setting is and in any order (the
jitted steps take the choice as a static argument, so the two keep their own
compilations). The model is a tiny Llama written as Q8_0 whose norm weights put an
outlier in every 32-value block of the activations: rounding such a block to 8 bits
zeroes most of its other values, so int8 and float32 decoding part within a few
tokens (checked first, so the comparisons can fail).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_cases import CONFIGS, WORDS
from click.testing import CliRunner

from entrenar import io, native, nn
from entrenar.chat import ChatModel
from entrenar.cli import cli
from entrenar.cli.decode_cmds import DECODE_ACTIVATIONS
from entrenar.errors import ConfigError
from entrenar.nn import matvec
from entrenar.quant.ggml import quantize_ggml
from entrenar.runs.inference import load_chat

KERNEL = native.reason("ggml_matvec")
pytestmark = pytest.mark.skipif(
    KERNEL is not None, reason=f"the kernel is off here: {KERNEL}"
)
TOKENIZER = WORDS / "tokenizer.gguf"
NEW = 12


@pytest.fixture(scope="module")
def q8_lm(tmp_path_factory):
    """A one-layer Llama saved as Q8_0, activations with an outlier per 32-block."""
    cfg = nn.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=1,
        num_heads=2, num_kv_heads=2, max_position_embeddings=64,
    )  # fmt: skip

    def outliers(path, leaf):  # (hidden,) norm weights: channel 0 of each block x30
        if "norm" in jax.tree_util.keystr(path):
            return leaf.at[..., ::32].multiply(30.0)
        return leaf

    params = jax.tree_util.tree_map(lambda x: x * 5, cfg.init(jax.random.key(1)))
    params = jax.tree_util.tree_map_with_path(outliers, params)
    path = tmp_path_factory.mktemp("q8") / "lm.gguf"
    io.save_llama_gguf(path, cfg, params, tensor_type="Q8_0")
    return path


@pytest.fixture(scope="module")
def session(q8_lm):
    return load_chat(str(q8_lm), tokenizer=str(TOKENIZER), keep_quantized=True)


def _setting(session, kind):
    """Token ids of the reply under the process setting ``kind``."""
    with matvec.activations(kind):
        return session.reply("12", chat=False, max_new_tokens=NEW).token_ids


@pytest.fixture(scope="module")
def expected(session):
    want = {kind: _setting(session, kind) for kind in ("float32", "int8")}
    assert want["float32"] != want["int8"], "the model must tell the two apart"
    return want


def test_choices_are_the_kernels():
    assert DECODE_ACTIVATIONS == matvec.ACTIVATIONS


def test_generate_keyword_overrides_the_process_setting(session, expected):
    prompt = jnp.asarray([session.encode("12", chat=False)], jnp.int32)  # (1, T)

    def run(kind):
        out = nn.generate(
            session.model, session.params, prompt, max_new_tokens=NEW,
            stop_tokens=session.stops, decode_activations=kind,
        )  # fmt: skip
        ids = [int(t) for t in np.asarray(out)[0]]
        return tuple(ids[: len(expected[kind or "float32"])])

    for setting, order in [("float32", ("int8", "float32", "int8")),
                           ("int8", ("float32", "int8", "float32"))]:  # fmt: skip
        with matvec.activations(setting):
            for kind in order:
                assert run(kind) == expected[kind], (setting, kind)
    assert run(None) == expected["float32"]  # None: the process setting
    with pytest.raises(ConfigError, match=r"'int4'.*choose one of float32, int8"):
        nn.generate(session.model, session.params, prompt, max_new_tokens=2,
                    decode_activations="int4")  # fmt: skip


def test_traced_activations_is_the_setting_inside_jit():
    rng = np.random.default_rng(0)
    w = quantize_ggml(rng.standard_normal((48, 96)).astype(np.float32), "q8_0")
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)  # (3, 96)

    def traced(kind):
        @jax.jit
        def f(x, w):
            with matvec.traced_activations(kind):
                return nn.linear(x, w)

        return np.asarray(f(x, w))

    with matvec.activations("int8"):
        int8 = np.asarray(jax.jit(nn.linear)(x, w))
    f32 = np.asarray(jax.jit(nn.linear)(x, w))
    assert not np.array_equal(int8, f32)
    np.testing.assert_array_equal(traced("int8"), int8)
    np.testing.assert_array_equal(traced("float32"), f32)
    with matvec.activations("int8"):
        np.testing.assert_array_equal(traced("float32"), f32)
        np.testing.assert_array_equal(traced(None), int8)


def test_chat_model_option(session, expected):
    for kind in ("int8", "float32", "int8"):
        chat = ChatModel(
            session.model, session.params, session.tokenizer,
            stop_ids=session.stop_ids, decode_activations=kind,
        )  # fmt: skip
        got = chat.reply("12", chat=False, max_new_tokens=NEW).token_ids
        assert got == expected[kind], kind
        pieces = chat.stream("12", chat=False, max_new_tokens=NEW)
        assert "".join(pieces) == session.tokenizer.decode(
            [t for t in expected[kind] if t not in session.stops]
        )
    with pytest.raises(ConfigError, match=r"ChatModel\.decode_activations"):
        ChatModel(session.model, session.params, session.tokenizer,
                  decode_activations="fp8")  # fmt: skip


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_cli_generate(q8_lm, session, expected):
    def text(kind):
        return session.tokenizer.decode(
            [t for t in expected[kind] if t not in session.stops]
        )

    base = ["generate", q8_lm, "--tokenizer", TOKENIZER, "-p", "12",
            "--max-new-tokens", NEW, "--no-stream", "--keep-quantized"]  # fmt: skip
    for kind in ("int8", "float32"):
        result = _cli(*base, "--decode-activations", kind)
        assert result.exit_code == 0, result.output
        assert result.output[:-1] == text(kind), kind
    default = _cli(*base)
    assert default.exit_code == 0 and default.output[:-1] == text("float32")
    bad = _cli(*base, "--decode-activations", "int4")
    assert bad.exit_code == 2
    assert "--decode-activations" in bad.output and "'int4'" in bad.output


def test_cli_eval_rejects_the_options_with_a_config():
    config = sorted(CONFIGS.glob("*.yaml"))[0]
    result = _cli("eval", config, "--decode-activations", "int8")
    assert result.exit_code == 2
    assert "--decode-activations" in result.output and "CONFIG" in result.output
