"""Padding and packing: layout properties, and packed logits equal unpacked ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.data import fit_documents, lm_loader, pack_rows, pad_rows
from entrenar.errors import ShapeError
from entrenar.io import BPETokenizer
from entrenar.nn import LlamaConfig


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, 50, n).astype(np.int32)
        labels = np.where(rng.random(n) < 0.3, -100, ids).astype(np.int32)
        out.append((ids, labels))
    return out


@given(st.lists(st.integers(1, 16), min_size=1, max_size=20), st.integers(1, 16))
def test_packing_layout(lengths, seq_len):
    docs = fit_documents(_docs(lengths), seq_len, "split")
    rows = pack_rows(_docs(lengths), seq_len, pad_id=1, overflow="split")
    n_rows = len(rows["input_ids"])
    assert n_rows <= len(docs)
    found = []
    for r in range(n_rows):
        seg, pos, mask = (
            rows[k][r] for k in ("segment_ids", "positions", "attention_mask")
        )
        used = int(mask.sum())
        assert mask[:used].all() and not mask[used:].any()  # documents, then padding
        assert (seg[used:] == 0).all() and (rows["input_ids"][r, used:] == 1).all()
        assert (rows["labels"][r, used:] == -100).all()
        for s in range(1, seg.max() + 1):
            (where,) = np.nonzero(seg == s)
            assert (np.diff(where) == 1).all()  # contiguous
            np.testing.assert_array_equal(pos[where], np.arange(len(where)))
            assert rows["labels"][r, where[0]] == -100  # no loss across documents
            found.append((rows["input_ids"][r, where], rows["labels"][r, where[1:]]))
    # Every document lands exactly once, its labels kept after the first token.
    key = sorted((a.tobytes(), b.tobytes()) for a, b in found)
    want = sorted((ids.tobytes(), lab[1:].tobytes()) for ids, lab in docs)
    assert key == want
    # A row was opened only when its first (largest) document fitted in no other
    # row, so no row's tokens would fit in another row's free space.
    used = rows["attention_mask"].sum(1)
    free = seq_len - used
    for i in range(n_rows):
        for j in range(n_rows):
            assert i == j or used[i] > free[j]


def test_padding_layout_and_overflow():
    docs = _docs([3, 7, 1])
    rows = pad_rows(docs, 5, pad_id=0)
    assert rows["input_ids"].shape == (3, 5) and rows["input_ids"].dtype == np.int32
    assert rows["attention_mask"].sum(1).tolist() == [3, 5, 1]
    np.testing.assert_array_equal(rows["input_ids"][1], docs[1][0][:5])  # truncated
    assert (rows["labels"][:, 0] == -100).all()
    assert len(pad_rows(docs, 5, overflow="split")["input_ids"]) == 4
    with pytest.raises(ShapeError, match="document 1 has 7 tokens"):
        pad_rows(docs, 5, overflow="error")


TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                   num_heads=4, num_kv_heads=2, max_position_embeddings=64)  # fmt: skip


APPLY = jax.jit(TINY.apply)


def _packed_apply(params, rows):
    return APPLY(
        params,
        jnp.asarray(rows["input_ids"]),
        mask=jnp.asarray(rows["attention_mask"]),
        segment_ids=jnp.asarray(rows["segment_ids"]),
        positions=jnp.asarray(rows["positions"]),
    )  # (R, T, V)


def _placed(rows):
    """{document's ids as bytes: (row, first column)} of a packed layout."""
    out = {}
    for r, seg in enumerate(rows["segment_ids"]):
        for s in range(1, seg.max() + 1):
            (where,) = np.nonzero(seg == s)
            out[rows["input_ids"][r, where].tobytes()] = (r, int(where[0]))
    return out


@pytest.fixture(scope="module")
def model_docs():
    """Params, 7 five-token documents, and each document's logits alone ``(7, 5, V)``.

    Equal lengths keep compilations few: one for the documents alone, one for the
    packed rows, one for the padded rows.
    """
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(  # random weights, drawn by numpy (init is slow)
        lambda shape: jnp.asarray(rng.normal(0, 0.2, shape), jnp.float32),
        TINY.param_shapes(),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    docs = _docs([5] * 7, seed=1)
    alone = APPLY(params, jnp.asarray(np.stack([ids for ids, _ in docs])))
    return params, docs, np.asarray(alone)


def test_packed_logits_equal_unpacked(model_docs):
    params, docs, alone = model_docs
    rows = pack_rows(docs, 16, pad_id=0)  # 3 documents at 0, 5, 10; then padding
    assert rows["segment_ids"].max() == 3 and len(rows["input_ids"]) == 3
    packed = _packed_apply(params, rows)  # (3, 16, V)
    placed = _placed(rows)
    got = [packed[r, at : at + 5] for r, at in (placed[bytes(d)] for d, _ in docs)]
    np.testing.assert_allclose(np.stack(got), alone, rtol=1e-5, atol=1e-5)
    # One segment per row and positions 0..T-1 (what no packing means): differs.
    t = np.arange(16, dtype=np.int32)
    plain = dict(rows, segment_ids=np.ones_like(rows["segment_ids"]),
                 positions=np.broadcast_to(t, rows["positions"].shape))  # fmt: skip
    assert not np.allclose(_packed_apply(params, plain), packed, atol=1e-3)


def test_padded_logits_equal_unpadded(model_docs):
    params, docs, alone = model_docs
    rows = pad_rows(docs, 16)  # (7, 16): 5 tokens, 11 padding
    out = APPLY(params, jnp.asarray(rows["input_ids"]),
                mask=jnp.asarray(rows["attention_mask"]))  # fmt: skip
    np.testing.assert_allclose(out[:, :5], alone, rtol=1e-5, atol=1e-5)


def test_lm_loader_batches_have_the_conventions_keys():
    tok = BPETokenizer(tokens=("a", "b", "ab", "Ġ", "<e>"), merges=("a b",),
                       token_types=(1, 1, 1, 1, 3), eos_id=4)  # fmt: skip
    recs = [{"text": t} for t in ["ab ab", "b", "a b a", "ab", "bbb", "a"]]
    for packing in (False, True):
        dl = lm_loader(recs, tok, seq_len=8, batch_size=4, packing=packing, seed=3)
        batches = list(dl)
        assert len(batches) == len(dl) >= 1
        keys = {"input_ids", "labels", "attention_mask"}
        keys |= {"segment_ids", "positions"} if packing else set()
        for b in batches:
            assert set(b) == keys
            for k, v in b.items():
                assert v.shape == (4, 8), k
                assert v.dtype == (bool if k == "attention_mask" else np.int32), k
            assert (b["labels"][~b["attention_mask"]] == -100).all()
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        assert tokens == dl.tokens_per_epoch() == sum(len(tok.encode(r["text"])) + 1
                                                      for r in recs)  # fmt: skip
