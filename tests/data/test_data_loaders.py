"""Loaders: order a pure function of (seed, epoch); positions save and restore."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.data import ArrayLoader, Loader, TextLoader, lm_loader
from entrenar.errors import ConfigError, FormatError
from entrenar.io import BPETokenizer


def _order(dl, epoch):
    dl.set_epoch(epoch)
    return np.concatenate([b["i"] for b in dl]).tolist()


def test_shuffling_reproducible_from_seed():
    arrays = {"i": np.arange(23), "x": np.arange(46.0).reshape(23, 2)}
    a = ArrayLoader(arrays, 4, seed=7, drop_last=False)
    b = ArrayLoader(arrays, 4, seed=7, drop_last=False)
    other = ArrayLoader(arrays, 4, seed=8, drop_last=False)
    assert isinstance(a, Loader)
    e0, e1 = _order(a, 0), _order(a, 1)
    assert sorted(e0) == sorted(e1) == list(range(23))  # each epoch a permutation
    assert e0 != e1 and e0 != _order(other, 0)
    # The same order whatever ran before: epoch 1 first, in a fresh loader.
    assert _order(b, 1) == e1 and _order(b, 0) == e0
    for batch in a:  # rows stay together
        np.testing.assert_array_equal(batch["x"][:, 0], 2.0 * batch["i"])
    no = ArrayLoader(arrays, 4, shuffle=False, drop_last=False)
    assert _order(no, 3) == list(range(23))


@given(st.integers(1, 30), st.integers(1, 8), st.booleans(), st.integers(0, 3))
def test_resume_anywhere_gives_the_same_batches(n, bs, drop, epoch):
    arrays = {"i": np.arange(n)}
    if drop and n < bs:
        return
    full = ArrayLoader(arrays, bs, seed=1, drop_last=drop)
    full.set_epoch(epoch)
    want = [b["i"].tolist() for b in full]
    assert len(want) == len(full)
    for k in range(len(want) + 1):
        first = ArrayLoader(arrays, bs, seed=1, drop_last=drop)
        first.set_epoch(epoch)
        it = iter(first)
        seen = [next(it)["i"].tolist() for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint
        resumed = ArrayLoader(arrays, bs, seed=1, drop_last=drop)
        resumed.load_state_dict(state)
        assert seen + [b["i"].tolist() for b in resumed] == want


def test_pad_fills_the_last_batch():
    dl = ArrayLoader({"i": np.arange(5), "w": np.ones(5)}, 2, shuffle=False,
                     pad=True, pad_values={"w": 0.0})  # fmt: skip
    batches = list(dl)
    assert len(dl) == 3 and [b["i"].shape for b in batches] == [(2,)] * 3
    assert batches[-1]["w"].tolist() == [1.0, 0.0]
    assert ArrayLoader({"i": np.arange(5)}, 2, drop_last=True).__len__() == 2
    with pytest.raises(ConfigError, match="unknown arrays"):
        ArrayLoader({"i": np.arange(5)}, 2, pad=True, pad_values={"j": 0})


TOK = BPETokenizer(tokens=("a", "b", "ab", "Ġ", "<e>"), merges=("a b",),
                   token_types=(1, 1, 1, 1, 3), eos_id=4)  # fmt: skip
RECS = [{"text": " ".join(["ab"] * (i % 5 + 1) + ["b"] * (i % 3))} for i in range(40)]


@pytest.mark.parametrize("packing", [False, True])
def test_text_loader_resumes(packing):
    def make():
        return lm_loader(RECS, TOK, seq_len=16, batch_size=3, packing=packing, seed=5)

    full = make()
    full.set_epoch(2)
    want = [b["input_ids"].tobytes() for b in full]
    stop = len(want) // 2
    first = make()
    first.set_epoch(2)
    it = iter(first)
    got = [next(it)["input_ids"].tobytes() for _ in range(stop)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert resumed.position == stop and resumed.epoch == 2
    assert got + [b["input_ids"].tobytes() for b in resumed] == want
    assert isinstance(full, TextLoader) and isinstance(full, Loader)


def test_text_loader_from_a_file(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in RECS))
    a = lm_loader(str(p), TOK, seq_len=16, batch_size=4, packing=True, seed=0)
    b = lm_loader(RECS, TOK, seq_len=16, batch_size=4, packing=True, seed=0)
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert a.documents == len(RECS)
    with pytest.raises(ConfigError, match="format must be one of"):
        lm_loader(RECS, TOK, format="dialogue", seq_len=8, batch_size=2)
    with pytest.raises(ConfigError, match="no tokens"):
        lm_loader([], TOK, seq_len=8, batch_size=2)


def test_an_empty_file_is_named(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(ConfigError, match=r"empty\.jsonl: holds no records"):
        lm_loader(str(p), TOK, seq_len=8, batch_size=2)
    p.write_text('{"text": ""}\n')
    with pytest.raises(ConfigError, match=r"empty\.jsonl: its 1 record holds no"):
        lm_loader(str(p), TOK, seq_len=8, batch_size=2, add_eos=False)


def test_auto_format_from_fields():
    pc = [{"q": "a", "a": "b"}]
    fields = {"prompt": "q", "completion": "a"}
    auto = lm_loader(pc, TOK, format="auto", fields=fields, seq_len=8, batch_size=1)
    want = lm_loader(pc, TOK, format="prompt_completion", fields=fields, seq_len=8,
                     batch_size=1)  # fmt: skip
    np.testing.assert_array_equal(
        next(iter(auto))["labels"], next(iter(want))["labels"]
    )
    with pytest.raises(FormatError, match=r"record 1: cannot tell the format"):
        lm_loader([{"body": "x"}], TOK, format="auto", seq_len=8, batch_size=1)


@pytest.mark.parametrize("packing", [False, True])
def test_records_without_a_loss_within_seq_len_get_no_row(packing):
    """As TRL's SFTTrainer drops them: a completion cut off entirely by seq_len.

    Such a row took a batch's place (and, alone in a batch, made a step with a
    zero gradient that still moved the weights through momentum and decay).
    """
    recs = [
        {"prompt": "ab " * 20, "completion": "b"},
        {"prompt": "a ", "completion": "b"},
    ]
    dl = lm_loader(recs, TOK, format="prompt_completion", seq_len=8, batch_size=1,
                   packing=packing, shuffle=False)  # fmt: skip
    assert len(dl) == 1 and dl.unlabelled == 1 and dl.documents == 2
    [batch] = list(dl)
    want = [*TOK.encode("a b"), TOK.eos_id]  # the second record: a, Ġ, b, EOS
    assert batch["attention_mask"].sum() == len(want)
    assert (batch["labels"] != -100).sum() == 2  # b and EOS
    with pytest.raises(ConfigError, match=r"none of its 1 record has a token with a "
                       r"loss in its first seq_len=8 tokens"):  # fmt: skip
        lm_loader(recs[:1], TOK, format="prompt_completion", seq_len=8, batch_size=1)
