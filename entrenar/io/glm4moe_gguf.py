"""GLM-4.5 / 4.5-Air / 4.6 (`entrenar.nn.Glm4MoeConfig`) as llama.cpp's ``glm4moe``.

llama.cpp 0.3.36 (src/models/glm4-moe.cpp) runs it; its converter
(conversion/glm.py, ``Glm4MoeModel``) writes it, and entrenar writes the same names
and keys. The layers are a list (dense first, then DeepSeekMoE), read and written
through `entrenar.io.deepseek_gguf`'s unrolled-layer helpers with this table::

    blk.N.attn_norm / post_attention_norm   input_layernorm / post_attention_layernorm
    blk.N.attn_q / attn_k / attn_v (.bias)  self_attn.{q,k,v}_proj   (attention_bias)
    blk.N.attn_q_norm / attn_k_norm {d}     self_attn.{q,k}_norm     (use_qk_norm)
    blk.N.attn_output                       self_attn.o_proj
    blk.N.ffn_gate/up/down                  mlp.*_proj               (dense layers)
    blk.N.ffn_gate_inp, exp_probs_b.bias    mlp.gate.weight, e_score_correction_bias
    blk.N.ffn_*_exps, ffn_*_shexp           mlp.experts.*, mlp.shared_experts.*

Keys: the converter's (``attention.key_length``/``value_length`` = ``head_dim``,
``rope.dimension_count`` = ``head_dim · partial_rotary_factor``,
``expert_feed_forward_length``, ``expert_shared_count``,
``leading_dense_block_count``, ``expert_gating_func`` 2 (sigmoid),
``expert_weights_scale`` = ``routed_scaling_factor``, ``expert_weights_norm`` =
``norm_topk_prob``, ``expert_group_count`` / ``expert_group_used_count`` = ``n_group``
/ ``topk_group``).

What llama.cpp computes (glm4-moe.cpp, llama-graph.cpp ``build_moe_ffn``): q/k/v
with their optional biases, per-head RMSNorm of q and k when ``attn_q_norm`` exists,
NEOX rotary (``LLAMA_ROPE_TYPE_NEOX``: Hugging Face's halves) on the first
``rope.dimension_count`` values of each head, so q/k rows are written as the
checkpoint's; sigmoid scores, ``exp_probs_b`` added for the choice only, DeepSeek-V3's
group limit when ``expert_group_count > 1`` (a group's top-2 sum, the
``expert_group_used_count`` best kept), the top-k weights renormalised when
``expert_weights_norm`` (the sum clamped below at 6.1e-5 where transformers adds
1e-20: the same for any sum of sigmoids a model gives), times
``expert_weights_scale``; the shared experts always added. transformers'
Glm4MoeTopkRouter computes the same.

Multi-token prediction: the Hub's checkpoints hold ``num_nextn_predict_layers``
(1) MTP layers past the last one, which entrenar skips on reading a folder. The
converter writes ``block_count`` = layers + MTP layers and ``nextn_predict_layers``,
and the MTP layers' tensors when the folder has them; llama.cpp makes those tensors
optional when ``blk.{L}.nextn.eh_proj`` is absent (``trunk_only``) and runs the
trunk's ``block_count - nextn_predict_layers`` layers. entrenar writes what the
converter writes for a folder with the trunk only (its own Hugging Face export): the
two keys, no MTP tensors. On reading, the MTP layers' tensors (``blk.N.*`` with ``N
>= block_count - nextn_predict_layers``) are skipped, as on reading a folder.

Refused by name (`check_glm4moe_gguf`): no routed experts (glm4-moe.cpp asserts
``n_expert > 0``), no shared expert (its graph adds the shared experts' FFN
unconditionally), a rotary scaling (GLM-4.5 has none; not written). ``topk_group``
equal to ``n_group`` > 1 keeps every group, which llama.cpp asserts against
(``n_group_used < n_expert_groups``): written as one group (the same routing), the
config's groups kept in ``entrenar.family``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from entrenar import nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.deepseek_gguf import GLOBAL, count_key, expert_scale, written_groups
from entrenar.io.gguf_families import SWITCH_FIELDS
from entrenar.io.gguf_meta import family_fields, meta_float, meta_int
from entrenar.io.gguf_reader import GGUFField, GGUFFile, GGUFValueType
from entrenar.nn.glm4_moe import Glm4MoeConfig
from entrenar.nn.hf_names import per_layer_shapes

NAME = "glm4moe"
"""llama.cpp's ``general.architecture`` of GLM-4.5 / 4.5-Air / 4.6."""
FAMILY = "glm4_moe"
"""entrenar's family (`entrenar.nn.glm4_moe`) of a ``glm4moe`` file."""
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    **{
        f"self_attn.{p}_proj.{kind}": f"attn_{p}.{kind}"
        for p in ("q", "k", "v")
        for kind in ("weight", "bias")
    },
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{
        f"mlp.{group}.{p}_proj.weight": f"ffn_{p}_{stem}.weight"
        for group, stem in (("experts", "exps"), ("shared_experts", "shexp"))
        for p in ("gate", "up", "down")
    },
}
"""A layer's Hugging Face name -> its GGUF name (after ``blk.N.``)."""
EXTRA_FIELDS = ("n_group", "topk_group", "routed_scaling_factor")
"""`Glm4MoeConfig` fields ``entrenar.family`` may hold beside `SWITCH_FIELDS`: the
groups written as one (module docstring) and the float the keys round."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BLK = re.compile(r"^blk\.(\d+)\.")


def gguf_tensor_names(config: Glm4MoeConfig) -> dict[str, str]:
    """Hugging Face name -> GGUF name of every tensor of ``config``."""
    out: dict[str, str] = {}
    for hf in per_layer_shapes(config):
        m = _LAYER.match(hf)
        if m is None:
            out[hf] = GLOBAL[hf]
        else:
            out[hf] = f"blk.{m.group(1)}.{LAYER[m.group(2)]}"
    return out


def mtp_tensors(g: GGUFFile, config: Glm4MoeConfig) -> set[str]:
    """The tensors of the MTP layers ``blk.N`` past the trunk's (module docstring)."""
    n = config.num_layers
    return {t for t in g.tensors if (m := _BLK.match(t)) and int(m.group(1)) >= n}


# ------------------------------------------------------------------- checks
def check_glm4moe_gguf(c: Glm4MoeConfig) -> None:
    """Refuse a config llama.cpp's glm4moe would compute otherwise (docstring).

    Raises:
        UnsupportedError: naming the field and what llama.cpp does instead.
    """
    why = None
    if not c.num_experts:
        why = "num_experts=0: llama.cpp's glm4moe asserts n_expert > 0"
    elif not c.n_shared_experts:
        why = (
            "n_shared_experts=0: llama.cpp's glm4moe adds its shared experts' FFN "
            "to every MoE layer (ffn_*_shexp)"
        )
    elif c.rope_type != "default":
        why = f"rope_type {c.rope_type!r}: entrenar writes GLM-4.5's plain rotary"
    if why is not None:
        raise UnsupportedError(
            f"this {c.architecture} config has no llama.cpp GGUF form: {why}"
        )


# ------------------------------------------------------------------- reading
def glm4moe_config_from_gguf(g: GGUFFile) -> Glm4MoeConfig:
    """The `Glm4MoeConfig` of a ``glm4moe`` GGUF's keys and tensor table.

    ``entrenar.family`` (a file entrenar wrote) is applied last.

    Raises:
        FormatError: missing or out-of-range keys, inconsistent sizes.
        UnsupportedError: a gating other than sigmoid, a rotary scaling, M-RoPE
            (GLM-4.5V's), a file of MTP layers only.
    """
    p = f"{NAME}."
    if "blk.0.attn_norm.weight" not in g.tensors:
        raise UnsupportedError(
            f"{g.path}: a glm4moe file without its trunk (no blk.0.attn_norm: the "
            "converter's --mtp-only draft file); entrenar reads the whole model"
        )
    gating = g.fields.get(f"{p}expert_gating_func")
    if gating is not None and gating.value not in (0, 2):  # 0: llama.cpp's sigmoid
        raise UnsupportedError(
            f"{g.path}: metadata {p}expert_gating_func = {gating.value!r}; GLM-4.5 "
            "routes by sigmoid (2)"
        )
    for key, what in (
        ("rope.scaling.type", "a rotary scaling"),
        ("rope.dimension_sections", "M-RoPE (GLM-4.5V's vision positions)"),
    ):
        f = g.fields.get(p + key)
        v = None if f is None else f.value
        off = v in ("none", "") or (
            isinstance(v, (list, tuple)) and not any(v)
        )  # (sections all 0: llama.cpp's use_mrope() is false)
        if v is not None and not off:
            raise UnsupportedError(
                f"{g.path}: metadata {p}{key} = {v!r}: entrenar reads GLM-4.5 "
                f"without {what}"
            )
    heads = meta_int(g, f"{p}attention.head_count")
    hidden = meta_int(g, f"{p}embedding_length")
    key_length = g.fields.get(f"{p}attention.key_length")  # (head_dim: always)
    head_dim = meta_int(g, f"{p}attention.key_length", hidden // heads)
    n_rot = meta_int(g, f"{p}rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise FormatError(
            f"{g.path}: {p}rope.dimension_count = {n_rot} must be even and at most "
            f"the head dimension {head_dim}"
        )
    n_all = meta_int(g, f"{p}block_count")
    nextn = count_key(g, f"{p}nextn_predict_layers", 0)
    if nextn >= n_all:
        raise FormatError(
            f"{g.path}: {p}nextn_predict_layers = {nextn} leaves no layer of "
            f"block_count = {n_all}"
        )
    n_layers = n_all - nextn
    emb = g.tensors.get("token_embd.weight")
    n_vocab = emb.shape[0] if emb is not None and len(emb.shape) == 2 else None
    groups = meta_int(g, f"{p}expert_group_count", 1)
    fields: dict[str, Any] = dict(
        vocab_size=meta_int(g, f"{p}vocab_size", n_vocab),
        hidden_size=hidden,
        intermediate_size=meta_int(g, f"{p}feed_forward_length"),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=meta_int(g, f"{p}attention.head_count_kv", heads),
        head_dim=None if key_length is None else head_dim,
        partial_rotary_factor=n_rot / head_dim,
        rope_theta=meta_float(g, f"{p}rope.freq_base", 10000.0),
        rms_norm_eps=meta_float(g, f"{p}attention.layer_norm_rms_epsilon", 1e-6),
        tie_word_embeddings="output.weight" not in g.tensors,
        max_position_embeddings=meta_int(g, f"{p}context_length", 2048),
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        first_k_dense_replace=min(
            n_layers, count_key(g, f"{p}leading_dense_block_count", 0)
        ),
        num_experts=meta_int(g, f"{p}expert_count"),
        num_experts_per_tok=meta_int(g, f"{p}expert_used_count"),
        moe_intermediate_size=meta_int(g, f"{p}expert_feed_forward_length"),
        n_shared_experts=meta_int(g, f"{p}expert_shared_count"),
        n_group=groups,
        topk_group=meta_int(g, f"{p}expert_group_used_count", groups),
        routed_scaling_factor=expert_scale(g, f"{p}expert_weights_scale"),
        norm_topk_prob=bool(
            getattr(g.fields.get(f"{p}expert_weights_norm"), "value", False)
        ),
        num_nextn_predict_layers=nextn,
    )
    fields |= family_fields(g, NAME, {*SWITCH_FIELDS, *EXTRA_FIELDS})
    fields.pop("architecture", None)
    try:
        return nn.architecture(FAMILY).make_config(**fields)
    except (ConfigError, TypeError, ValueError) as e:
        raise FormatError(f"{g.path}: inconsistent {NAME}.* metadata: {e}") from None


def expected_tensors(
    g: GGUFFile, config: Glm4MoeConfig
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (Hugging Face name, shape) of every tensor ``config`` implies.

    The MTP layers' tensors are listed with an empty name (skipped on loading).
    """
    shapes = per_layer_shapes(config)
    out = {name: (hf, shapes[hf]) for hf, name in gguf_tensor_names(config).items()}
    for t in mtp_tensors(g, config):
        out[t] = ("", g.tensors[t].shape)
    return out


# ------------------------------------------------------------------- writing
def glm4moe_keys(c: Glm4MoeConfig, kind_id: int) -> dict[str, GGUFField]:
    """The ``glm4moe.*`` keys of ``c`` (module docstring), as the converter's."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    groups, used = written_groups(c.n_group, c.topk_group)
    new: dict[str, tuple[Any, GGUFValueType]] = {
        "vocab_size": (c.vocab_size, u32),
        "block_count": (c.num_layers + c.num_nextn_predict_layers, u32),
        "context_length": (c.max_position_embeddings, u32),
        "embedding_length": (c.hidden_size, u32),
        "feed_forward_length": (c.intermediate_size, u32),
        "attention.head_count": (c.num_heads, u32),
        "attention.head_count_kv": (c.num_kv_heads, u32),
        "rope.freq_base": (c.rope_theta, f32),
        "attention.layer_norm_rms_epsilon": (c.rms_norm_eps, f32),
        "expert_count": (c.num_experts, u32),
        "expert_used_count": (c.num_experts_per_tok, u32),
        "expert_group_count": (groups, u32),
        "expert_group_used_count": (used, u32),
        "attention.key_length": (c.hd, u32),
        "attention.value_length": (c.hd, u32),
        "rope.dimension_count": (c.rotary_dim, u32),
        "expert_feed_forward_length": (c.expert_size, u32),
        "expert_shared_count": (c.n_shared_experts, u32),
        "leading_dense_block_count": (c.first_k_dense_replace, u32),
        "expert_gating_func": (2, u32),  # sigmoid
        "expert_weights_scale": (float(c.routed_scaling_factor), f32),
        "expert_weights_norm": (bool(c.norm_topk_prob), GGUFValueType.BOOL),
        "nextn_predict_layers": (c.num_nextn_predict_layers, u32),
    }
    out = {f"{NAME}.{k}": GGUFField(v, t) for k, (v, t) in new.items()}
    out["general.file_type"] = GGUFField(kind_id, u32)
    return out


def family_json(c: Glm4MoeConfig, switches: dict[str, Any]) -> str:
    """``entrenar.family``: the switches and `EXTRA_FIELDS` the keys do not give."""
    out = dict(switches, architecture=c.architecture)
    if written_groups(c.n_group, c.topk_group) != (c.n_group, c.topk_group):
        out |= {"n_group": c.n_group, "topk_group": c.topk_group}
    scale = float(c.routed_scaling_factor)
    if float(str(np.float32(scale))) != scale:  # as `meta_float` reads the key
        out["routed_scaling_factor"] = scale
    return json.dumps(out)


def row_widths(c: Glm4MoeConfig) -> tuple[int, ...]:
    """The row lengths of every matrix, for a quantized type's 32-value blocks."""
    widths = {c.hidden_size, c.num_heads * c.hd, c.intermediate_size, c.expert_size,
              c.expert_size * c.n_shared_experts}  # fmt: skip
    return tuple(sorted(widths))


__all__ = [
    "EXTRA_FIELDS",
    "LAYER",
    "NAME",
    "check_glm4moe_gguf",
    "expected_tensors",
    "family_json",
    "gguf_tensor_names",
    "glm4moe_config_from_gguf",
    "glm4moe_keys",
    "mtp_tensors",
    "row_widths",
]
