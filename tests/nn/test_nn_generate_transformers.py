"""Greedy `generate` equals transformers' ``generate(do_sample=False)``, every family.

Tiny random models of each registered family (the transformers model of
``arch.to_hf(tiny)``, float32, eager attention, its state dict taken into entrenar
with `from_hf_names`), with weights noisy enough that the greedy tokens vary. Prompts
longer than the sliding windows (4) and replies that cross them; a batch of prompts
of different lengths (transformers pads on the left, entrenar keeps a position per
row) and one that shares a prefix; a prompt past a cache bucket. Phi-3's longrope
switches to its long factors once the sequence passes
``original_max_position_embeddings`` (8 in its tiny config): transformers then
recomputes the whole cache with them (Phi-3's ``prepare_inputs_for_generation``).
A dynamic (NTK) model's base grows past ``max_position_embeddings`` with each
step's length, the cache kept (transformers' ``dynamic_rope_update``). A list of
EOS ids (a ``generation_config.json``'s) stops each row at its own.
"""

import dataclasses

import numpy as np
import pytest

from entrenar import nn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = [a.name for a in nn.architectures() if a.hf_class and a.tiny]
OVERRIDES = {
    # tied and scaled embeddings repeat the last token; soft caps of 1 and 2 saturate
    # the logits into float ties: real Gemma 2 caps at 50 and 30
    "gemma2": dict(
        tie_word_embeddings=False,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3": dict(tie_word_embeddings=False),
    # OLMo 2's biases, 0.4 off zero, outweigh the normalised sublayer outputs: the
    # reply repeats one token (biases are checked in tests/nn/test_families.py)
    "olmo2": dict(attention_bias=False, attention_out_bias=False),
    # GLM's q/k/v biases, 0.4 off zero, fix the scores: the reply repeats a token
    "glm": dict(attention_bias=False),
    "mistral": dict(max_position_embeddings=64),  # tiny: 8, too short to generate
    # the tied table repeats the last token (as Gemma 3's): untied, as transformers
    # allows Cohere models to be
    "cohere": dict(tie_word_embeddings=False),
    "cohere2": dict(tie_word_embeddings=False),
}
CASES = [  # (prompt lengths, new tokens, tokens the rows share at the start)
    ((3,), 12, 0),  # crosses the windows and Phi-3's switch while decoding
    ((5, 11, 2), 9, 0),
    ((17, 18), 6, 16),
    ((33, 1), 12, 0),  # past one prompt bucket (32)
]


pytestmark = pytest.mark.usefixtures("quick_compiles")


def _build(name, **over):
    arch = nn.architecture(name)
    config = dataclasses.replace(arch.tiny(), **{**OVERRIDES.get(name, {}), **over})
    hf_cfg = transformers.AutoConfig.for_model(**arch.to_hf(config))
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.4 * torch.randn(p.shape, generator=gen))
    flat = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return config, nn.from_hf_names(flat, config), model


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return _build(request.param)


def _hf_generate(model, rows, n):
    """The transformers greedy continuation of ``rows`` (left-padded), ``(B, n)``."""
    t = max(len(r) for r in rows)
    ids = np.zeros((len(rows), t), np.int64)
    mask = np.zeros((len(rows), t), np.int64)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :], mask[i, t - len(r) :] = r, 1
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
            max_new_tokens=n, min_new_tokens=n, do_sample=False,
        )  # fmt: skip
    return out[:, t:].numpy()


def _prompts(vocab, lens, shared, seed):
    rng = np.random.default_rng(seed)
    rows = [rng.integers(1, vocab, size=n).tolist() for n in lens]
    for r in rows[1:]:
        r[:shared] = rows[0][:shared]
    return rows


@pytest.mark.parametrize("lens,n,shared", CASES, ids=str)
def test_greedy_generation_equals_transformers(family, lens, n, shared):
    config, params, model = family
    rows = _prompts(config.vocab_size, lens, shared, seed=sum(lens))
    n = min(n, config.max_position_embeddings - max(lens))
    if n < 1:
        pytest.skip(f"a context of {config.max_position_embeddings} tokens")
    want = _hf_generate(model, rows, n)
    got = np.asarray(nn.generate(config, params, rows, max_new_tokens=n))
    assert len(set(want.ravel().tolist())) > 2  # not a degenerate model
    np.testing.assert_array_equal(got, want)


PHI3_CASES = [  # (original_max_position_embeddings, prompt lengths, shared tokens)
    (8, (3,), 0),  # the reply crosses 8
    (8, (8,), 0),  # at 8: the first step crosses
    (8, (9,), 0),  # past 8: long factors from the start
    (8, (2, 7), 0),
    (8, (7, 6, 5, 4, 3, 2), 0),  # no bucket padding past 8 in the prompt
    (20, (23, 21), 16),  # a shared prefix below 20, prompts past it
]


@pytest.mark.parametrize("switch,lens,shared", PHI3_CASES, ids=str)
def test_phi3_long_factors_switch_as_in_transformers(switch, lens, shared):
    """Prompts below, at and past Phi-3's switch; replies crossing it."""
    config, params, model = _build(
        "phi3", rope_original_max_position_embeddings=switch,
        max_position_embeddings=4 * switch,
    )  # fmt: skip
    rows = _prompts(config.vocab_size, lens, shared, seed=0)
    n = min(12, config.max_position_embeddings - max(lens))
    if len(lens) > 2:  # each row stays below the switch
        n = switch - max(lens)
    want = _hf_generate(model, rows, n)
    got = np.asarray(nn.generate(config, params, rows, max_new_tokens=n))
    np.testing.assert_array_equal(got, want)


DYNAMIC_CASES = [  # (prompt lengths, new tokens, shared tokens); M = 16
    ((5,), 20, 0),  # the reply passes M: each step's base grows, the cache is kept
    ((12,), 12, 0),  # bucket padding past M would grow the prompt's base
    ((5, 11, 2), 20, 0),
    ((20,), 8, 0),  # past M from the start: no padding past the prompt
    ((17, 18), 10, 16),  # no prefix of 16 run alone with the base of 16
]


@pytest.mark.parametrize("lens,n,shared", DYNAMIC_CASES, ids=str)
def test_dynamic_ntk_past_max_position_as_in_transformers(lens, n, shared):
    """Dynamic NTK rotary scaling below, across and past ``max_position_embeddings``.

    Before, the prompt's bucket padding (to 16 or 32 positions) counted as
    sequence length and grew the base: the 12-token prompt's second token differed.
    """
    config, params, model = _build(
        "llama", rope_type="dynamic", rope_factor=2.0,
        rope_original_max_position_embeddings=None, max_position_embeddings=16,
    )  # fmt: skip
    rows = _prompts(config.vocab_size, lens, shared, seed=sum(lens))
    want = _hf_generate(model, rows, n)
    got = np.asarray(nn.generate(config, params, rows, max_new_tokens=n))
    np.testing.assert_array_equal(got, want)


def test_eos_lists_stop_rows_as_in_transformers():
    """A generation_config-style list of EOS ids: each row stops at its own."""
    config, params, model = _build("llama")
    rows = _prompts(config.vocab_size, (5, 11, 2), 0, seed=3)
    free = np.asarray(nn.generate(config, params, rows, max_new_tokens=10))
    eos = [int(free[0, 3]), int(free[2, 6])]  # rows 0 and 2 stop, at steps <= 3, 6
    t = max(len(r) for r in rows)
    ids, mask = np.zeros((3, t), np.int64), np.zeros((3, t), np.int64)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :], mask[i, t - len(r) :] = r, 1
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 95
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
            max_new_tokens=10, do_sample=False,
        )  # fmt: skip
    got = nn.generate(
        config, params, rows, max_new_tokens=10, stop_tokens=eos, pad_token=95
    )
    np.testing.assert_array_equal(np.asarray(got), out[:, t:].numpy())
