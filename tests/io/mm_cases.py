"""Tiny random Gemma 3 / Mistral 3 vision-language folders, made by transformers.

``save(kind, folder, layout=...)`` writes a ``Gemma3ForConditionalGeneration`` or
``Mistral3ForConditionalGeneration`` of a few kilobytes in float32: the Hub's
(legacy) key layout as transformers 5's ``save_pretrained`` writes it, or the
in-memory layout (``model.language_model.*``, what transformers 4.52-4.57 saved),
written from the model's own ``state_dict``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
TOKENS = np.arange(11).reshape(1, 11) * 7 % 90  # (1, 11), longer than the window

GEMMA3_TEXT = dict(  # the sizes only: the rest from Gemma3TextConfig's defaults
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=24,
    max_position_embeddings=64,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)
MISTRAL_TEXT = dict(
    model_type="mistral",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    sliding_window=None,
    rope_theta=1e6,
)


def config(kind: str, **text):
    """The transformers config of a tiny ``"gemma3"`` or ``"mistral3"`` model."""
    if kind == "gemma3":
        return transformers.Gemma3Config(
            text_config={**GEMMA3_TEXT, **text},
            vision_config=dict(
                hidden_size=16,
                intermediate_size=24,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
            boi_token_index=VOCAB - 3,
            eoi_token_index=VOCAB - 2,
            image_token_index=VOCAB - 1,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
        )
    return transformers.Mistral3Config(
        text_config={**MISTRAL_TEXT, **text},
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=28,
            patch_size=14,
        ),
        spatial_merge_size=1,
        image_token_index=VOCAB - 1,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
    )


def model(kind: str, **text):
    """A random ConditionalGeneration model (weights ~ N(0, 0.2)), eval mode."""
    cls = (
        transformers.Gemma3ForConditionalGeneration
        if kind == "gemma3"
        else transformers.Mistral3ForConditionalGeneration
    )
    torch.manual_seed(0)
    m = cls(config(kind, **text)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m


def save(m, folder, *, layout: str = "legacy", shard: str | None = None) -> None:
    """``m`` saved to ``folder`` in ``layout`` (``"legacy"`` or ``"in-memory"``)."""
    kwargs = {} if shard is None else {"max_shard_size": shard}
    m.save_pretrained(folder, **kwargs)
    if layout == "legacy":
        return
    from safetensors.torch import save_file

    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    if shard is None:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(state)  # two shards and their index
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    weight_map = {}
    for file, part in halves.items():
        save_file({k: state[k] for k in part}, folder / file, {"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def text_logits(m, tokens: np.ndarray = TOKENS) -> np.ndarray:
    """The ConditionalGeneration forward's logits on ``input_ids`` only."""
    with torch.no_grad():
        return m(input_ids=torch.tensor(tokens)).logits.numpy()


HUB_KEYS = (  # Gemma 3 4B's text_config names these; the sizes a tiny model needs
    "hidden_size", "intermediate_size", "model_type", "num_hidden_layers",
    "rope_scaling", "sliding_window", "vocab_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip


def keep_text_config(folder, keys=HUB_KEYS) -> None:
    """Keep only ``keys`` of ``config.json``'s ``text_config`` (as the Hub's 4B)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["text_config"] = {k: v for k, v in cfg["text_config"].items() if k in keys}
    cfg["text_config"]["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    path.write_text(json.dumps(cfg))
