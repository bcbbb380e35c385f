"""Tiny random vision-language folders, made by transformers.

``save(model(kind), folder, layout=...)`` writes a ConditionalGeneration model of
one of `KINDS` (Gemma 3, Mistral 3, Ministral 3, LLaVA, LLaVA-NeXT, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) of a few kilobytes in float32: the Hub's
(legacy) key layout as transformers 5's ``save_pretrained`` writes it, or the
in-memory layout
(``model.language_model.*``, what transformers 4.52-4.57 saved), written from the
model's own ``state_dict`` (Qwen3-VL and Qwen3-VL-MoE have only that one).
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


QWEN_TEXT = dict(  # head_dim 16: mrope_section [2, 3, 3] sums to d/2 = 8
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
)
QWEN3_TEXT = dict(
    QWEN_TEXT,
    head_dim=16,
    rope_scaling={
        "rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True
    },
)  # fmt: skip
QWEN3_MOE_TEXT = dict(  # experts 24 wide: gate_up (4, 48, 32) is not square
    QWEN3_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24
)
LLAMA_TEXT = dict(MISTRAL_TEXT, model_type="llama", rope_theta=1e4)
CLIP = dict(
    model_type="clip_vision_model",
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    projection_dim=16,
)
PIXTRAL = dict(
    model_type="pixtral",
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    head_dim=8,
    image_size=28,
    patch_size=14,
)
QWEN_IDS = dict(
    image_token_id=VOCAB - 1,
    video_token_id=VOCAB - 2,
    vision_start_token_id=VOCAB - 3,
    vision_end_token_id=VOCAB - 4,
)
MINISTRAL3_ROPE = {  # Ministral3Config's, but the query scale from position 4
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 16.0,
    "original_max_position_embeddings": 4,
    "max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}

KINDS = (
    "gemma3", "mistral3", "ministral3", "llava", "llava_next", "qwen2_vl",
    "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
)  # fmt: skip
"""Each wrapper, and ``ministral3`` (a ``mistral3`` folder of Ministral 3)."""
WRAPPER = {k: k for k in KINDS} | {"ministral3": "mistral3"}
FAMILY = {
    "gemma3": "gemma3", "mistral3": "mistral", "ministral3": "ministral3",
    "llava": "llama", "llava_next": "mistral", "qwen2_vl": "qwen2",
    "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
}  # fmt: skip
LAYOUTS = {k: ("legacy", "in-memory") for k in KINDS} | {
    "qwen3_vl": ("in-memory",),
    "qwen3_vl_moe": ("in-memory",),
}
"""The key layouts transformers 5.25 loads for each (Qwen3-VL: its own names)."""
TIE_DEFAULT = {"gemma3": True}


def config(kind: str, **text):
    """The transformers config of a tiny model of one of `KINDS`."""
    tie = bool(text.get("tie_word_embeddings", TIE_DEFAULT.get(kind, False)))
    t = transformers
    if kind == "gemma3":
        return t.Gemma3Config(
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
            tie_word_embeddings=tie,
        )
    if kind in ("mistral3", "ministral3"):
        base = MISTRAL_TEXT if kind == "mistral3" else dict(
            MISTRAL_TEXT, model_type="ministral3", rope_parameters=MINISTRAL3_ROPE
        )  # fmt: skip
        if kind == "ministral3":
            base.pop("rope_theta")
        return t.Mistral3Config(
            text_config={**base, **text},
            vision_config=PIXTRAL,
            spatial_merge_size=1,
            image_token_index=VOCAB - 1,
            tie_word_embeddings=tie,
        )
    if kind in ("llava", "llava_next"):
        base = LLAMA_TEXT if kind == "llava" else dict(MISTRAL_TEXT, sliding_window=4)
        cls = t.LlavaConfig if kind == "llava" else t.LlavaNextConfig
        extra = {"image_grid_pinpoints": [[28, 28]]} if kind == "llava_next" else {}
        return cls(
            text_config={**base, **text},
            vision_config=CLIP,
            image_token_index=VOCAB - 1,
            tie_word_embeddings=tie,
            **extra,
        )
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        moe = kind == "qwen3_vl_moe"
        cls = t.Qwen3VLMoeConfig if moe else t.Qwen3VLConfig
        return cls(
            text_config={**(QWEN3_MOE_TEXT if moe else QWEN3_TEXT), **text},
            vision_config=dict(
                depth=2,
                hidden_size=16,
                intermediate_size=24,
                num_heads=2,
                out_hidden_size=32,
                deepstack_visual_indexes=[0, 1],
                patch_size=14,
                num_position_embeddings=16,
            ),
            tie_word_embeddings=tie,
            **QWEN_IDS,
        )
    if kind == "qwen2_vl":
        vision = dict(
            depth=1,
            embed_dim=16,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        return t.Qwen2VLConfig(
            text_config={**QWEN_TEXT, **text},
            vision_config=vision,
            tie_word_embeddings=tie,
            **QWEN_IDS,
        )
    return t.Qwen2_5_VLConfig(
        text_config={**QWEN_TEXT, **text},
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=24,
            num_heads=2,
            out_hidden_size=32,
            fullatt_block_indexes=[0],
            window_size=28,
            patch_size=14,
        ),
        tie_word_embeddings=tie,
        **QWEN_IDS,
    )


CLASSES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "ministral3": "Mistral3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}


def model(kind: str, **text):
    """A random ConditionalGeneration model (weights ~ N(0, 0.2)), eval mode."""
    cls = getattr(transformers, CLASSES[kind])
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
