"""DeepSeek-V2 / V3 (`entrenar.nn.DeepseekConfig`) as llama.cpp's ``deepseek2`` GGUF.

llama.cpp (src/models/deepseek2.cpp) runs both under one name; its converter
(conversion/deepseek.py, ``DeepseekV2Model``) writes them so, and so does entrenar.

Tensors (``N`` = layer; DeepSeek's layers are a list, dense then MoE)::

    blk.N.attn_norm / ffn_norm        input_layernorm / post_attention_layernorm
    blk.N.attn_q                      self_attn.q_proj            (no q_lora_rank)
    blk.N.attn_q_a, attn_q_a_norm,    self_attn.q_a_proj, q_a_layernorm, q_b_proj
          attn_q_b
    blk.N.attn_kv_a_mqa, attn_kv_a_norm   kv_a_proj_with_mqa, kv_a_layernorm
    blk.N.attn_k_b (H, r, d_n)        kv_b_proj (H (d_n + d_v), r) split per head:
    blk.N.attn_v_b (H, d_v, r)          k_b its first d_n rows transposed, v_b the rest
    blk.N.attn_output                 self_attn.o_proj
    blk.N.ffn_gate/up/down            mlp.*_proj                  (dense layers)
    blk.N.ffn_gate_inp, exp_probs_b   mlp.gate.weight, e_score_correction_bias (F32)
    blk.N.ffn_*_exps, ffn_*_shexp     mlp.experts.*, mlp.shared_experts.*

(``attn_k_b``/``attn_v_b``: the split newer llama.cpp needs for its absorbed MLA,
``attention.key_length_mla`` set; a legacy file with one ``attn_kv_b`` is refused.)

Keys: ``head_count_kv`` 1 (MLA as one shared latent), ``attention.key_length`` ``r +
d_r`` and ``value_length`` ``r`` (the latent cache), ``key_length_mla`` ``d_n +
d_r``, ``value_length_mla`` ``d_v``, ``rope.dimension_count`` ``d_r``,
``attention.q_lora_rank`` (0: V2-Lite's ``q_proj``; llama.cpp requires the key but
for 26/27-layer models), ``kv_lora_rank``, ``leading_dense_block_count``,
``expert_feed_forward_length``, ``expert_count``, ``expert_used_count``,
``expert_shared_count``, ``expert_weights_scale`` (``routed_scaling_factor``),
``expert_weights_norm`` (``norm_topk_prob``), ``expert_gating_func`` (1 softmax: V2,
2 sigmoid: V3), ``expert_group_count``/``expert_group_used_count`` (V3's groups).

Rotary: llama.cpp's ``deepseek2`` turns consecutive pairs (its NORM rope), which are
the checkpoints' interleaved pairs (``rope_interleave``), so nothing is permuted.
Under YaRN it scales ``cos``/``sin`` by ``A`` (``rope.scaling.attn_factor``) and the
scores by ``A² g(M)² / √d_qk`` with ``g(M) = 0.1 M ln(factor) + 1`` and ``M =
rope.scaling.yarn_log_multiplier / 0.1`` (src/llama-context.cpp and deepseek2.cpp,
[TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]); without the multiplier, ``cos``/``sin`` by ``A
g(1)`` and the scores by that squared. transformers scales ``cos``/``sin`` by the
config's attention factor ``c`` and the scores by ``g(mscale_all_dim)² / √d_qk``,
so entrenar writes ``A = c`` and ``g(M) = g(mscale_all_dim) / c`` (`yarn_keys`) and
reads the inverse (the converter's files, ``A`` 1 and ``M = mscale_all_dim``,
included).

Refused by name (`check_deepseek_gguf`): biases (deepseek2.cpp has none), no shared
expert (its ``ffn_*_shexp`` are required), rope pairs not interleaved, a rotary
scaling other than YaRN, and V2's ``group_limited_greedy`` over several groups
(llama.cpp ranks a group by the sum of its top two scores, V2 by its maximum;
``greedy`` is written without groups). ``entrenar.family`` keeps what the keys
round: the family and the exact floats.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from entrenar import nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.ggml_dequant import dequantize_ggml
from entrenar.io.gguf_families import FAMILY_KEY, SWITCH_FIELDS
from entrenar.io.gguf_meta import family_fields, meta_float, meta_int
from entrenar.io.gguf_reader import GGUFField, GGUFFile, GGUFMetadata, GGUFValueType
from entrenar.nn.deepseek import DeepseekConfig
from entrenar.nn.deepseek_moe import DeepseekMoeConfig
from entrenar.nn.hf_names import Quantize, per_layer_shapes, quantize_leaves
from entrenar.nn.rope_scaling import attention_factor, yarn_mscale
from entrenar.nn.weight_node import to_dense
from entrenar.types import Params

NAME = "deepseek2"
"""llama.cpp's ``general.architecture`` of DeepSeek-V2 and V3."""
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
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
KV_B = ("attn_k_b.weight", "attn_v_b.weight")
"""``self_attn.kv_b_proj.weight`` as llama.cpp's two tensors (module docstring)."""
F32_NAMES = ("ffn_gate_inp.weight", "exp_probs_b.bias")
"""Kept F32 whatever the file's type (the converter's rule for the router)."""
EXPERT_STACK = re.compile(r"\.ffn_(gate|up|down)_exps\.weight$")
"""The routed experts' stacks, which ``expert_type`` may write in their own type."""
GATING = {"softmax": 1, "sigmoid": 2}
"""``scoring_func`` -> llama.cpp's ``expert_gating_func``."""
EXTRA_FIELDS = (
    "rope_mscale_all_dim",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "topk_method",
    "num_nextn_predict_layers",
)
"""`DeepseekConfig` fields ``entrenar.family`` may hold beside `SWITCH_FIELDS`: the
floats the keys round, and what llama.cpp's keys cannot state (V2's greedy
routing's groups, the multi-token-prediction layers it skips)."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def gguf_tensor_names(config: DeepseekConfig) -> dict[str, Any]:
    """Hugging Face name -> GGUF name, or ``kv_b_proj``'s pair (`KV_B`)."""
    out: dict[str, Any] = {}
    for hf in per_layer_shapes(config):
        m = _LAYER.match(hf)
        if m is None:
            out[hf] = GLOBAL[hf]
        elif m.group(2) == "self_attn.kv_b_proj.weight":
            out[hf] = tuple(f"blk.{m.group(1)}.{n}" for n in KV_B)
        else:
            out[hf] = f"blk.{m.group(1)}.{LAYER[m.group(2)]}"
    return out


def split_kv_b(w: np.ndarray, c: DeepseekConfig) -> tuple[np.ndarray, np.ndarray]:
    """``kv_b_proj (H (d_n + d_v), r)`` -> ``k_b (H, r, d_n)``, ``v_b (H, d_v, r)``.

    As llama.cpp's converter: per head, the first ``d_n`` rows (keys, transposed)
    and the other ``d_v`` (values).
    """
    h, dn = c.num_heads, c.qk_nope_head_dim
    kv = np.asarray(w).reshape(h, dn + c.v_head_dim, -1)  # (H, d_n + d_v, r)
    return np.swapaxes(kv[:, :dn], 1, 2), kv[:, dn:]


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """The inverse of `split_kv_b`: ``(H (d_n + d_v), r)``."""
    kv = np.concatenate([np.swapaxes(k_b, 1, 2), v_b], axis=1)  # (H, d_n + d_v, r)
    return kv.reshape(-1, kv.shape[-1])


# ------------------------------------------------------------------- rotary
def _g(factor: float, m: float) -> float:
    """``0.1 m ln(factor) + 1`` (1 for a factor up to 1), transformers' mscale."""
    return yarn_mscale(factor, m) if m else 1.0


def yarn_keys(c: DeepseekConfig) -> tuple[float, float | None]:
    """``(rope.scaling.attn_factor A, yarn_log_multiplier or None)`` for llama.cpp.

    ``A = c`` (transformers' ``cos``/``sin`` factor) and ``0.1 M`` with ``g(M) =
    g(mscale_all_dim) / c``, or, where that ``M`` is 0 (the multiplier unset),
    ``A = c / g(1)`` (module docstring).
    """
    f, cos = float(c.rope_factor), attention_factor(c)
    want = _g(f, float(c.rope_mscale_all_dim)) / cos  # g(M) llama.cpp must use
    if f <= 1 or want == 1.0:
        return cos / yarn_mscale(f), None
    return cos, (want - 1.0) / math.log(f)  # 0.1 M


def yarn_fields(f: float, a: float, log_mul: float | None) -> dict[str, Any]:
    """`yarn_keys`' inverse: ``rope_attention_factor`` and ``rope_mscale_all_dim``.

    The factor is None where it is the one a config without it derives.
    """
    if f <= 1:
        return {}
    cos = a if log_mul is not None else a * yarn_mscale(f)
    g = cos * (1.0 + (log_mul or 0.0) * math.log(f))  # g(mscale_all_dim)
    m = (g - 1.0) / (0.1 * math.log(f))
    derived = math.isclose(cos, yarn_mscale(f), rel_tol=1e-6)  # the config's None
    return {
        "rope_attention_factor": None if derived else cos,
        "rope_mscale_all_dim": 0.0 if abs(m) < 1e-6 else m,
    }


# ------------------------------------------------------------------- checks
def check_deepseek_gguf(c: DeepseekConfig) -> None:
    """Refuse a config llama.cpp's deepseek2 would compute otherwise (docstring).

    Raises:
        UnsupportedError: naming the field and what llama.cpp does instead.
    """
    family = c.architecture
    why = None
    if c.attention_bias or c.attention_out_bias:
        why = "attention biases: llama.cpp's deepseek2 has none"
    elif c.num_experts and not c.n_shared_experts:
        why = "n_shared_experts=0: llama.cpp's deepseek2 needs its shared experts"
    elif not c.rope_interleave:
        why = (
            "rope_interleave=False: llama.cpp's deepseek2 turns consecutive pairs "
            "(the checkpoints' interleaved layout)"
        )
    elif c.rope_type not in ("default", "yarn"):
        why = f"rope_type {c.rope_type!r}: entrenar writes DeepSeek's YaRN or none"
    elif c.topk_method == "group_limited_greedy" and c.topk_group < c.n_group:
        why = (
            "topk_method 'group_limited_greedy' over "
            f"{c.topk_group} of {c.n_group} groups: llama.cpp ranks a group by the "
            "sum of its top two scores, DeepSeek-V2 by its maximum"
        )
    if why is not None:
        raise UnsupportedError(
            f"this {family} config has no llama.cpp GGUF form: {why}"
        )


# ------------------------------------------------------------------- reading
def count_key(g: GGUFFile, key: str, default: int) -> int:
    """A count that may be 0 (``leading_dense_block_count``): an int in [0, 2^31)."""
    f = g.fields.get(key)
    if f is None:
        return default
    v = f.value
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 31:
        raise FormatError(f"{g.path}: metadata {key!r} = {v!r}, want an int >= 0")
    return int(v)


def deepseek_family(metadata: Mapping[str, Any]) -> str:
    """The family of a ``deepseek2`` file's metadata: V3 if it gates by sigmoid."""
    family = metadata.get(FAMILY_KEY)
    try:
        named = json.loads(family).get("architecture") if family else None
    except (ValueError, AttributeError, RecursionError):
        named = None
    if named in ("deepseek_v2", "deepseek_v3"):
        return str(named)
    gating = metadata.get(f"{NAME}.expert_gating_func")
    return "deepseek_v3" if gating == GATING["sigmoid"] else "deepseek_v2"


def deepseek_config_from_gguf(g: GGUFFile) -> DeepseekConfig:
    """The `DeepseekConfig` of a ``deepseek2`` GGUF's keys and tensor table.

    Softmax gating (``expert_gating_func`` 1, llama.cpp's default) is DeepSeek-V2,
    sigmoid (2) V3; ``entrenar.family`` (a file entrenar wrote) is applied last.

    Raises:
        FormatError: missing or out-of-range keys, inconsistent sizes.
        UnsupportedError: a legacy file (one ``attn_kv_b``), a gating or rotary
            scaling entrenar does not compute, V2 routing with groups.
    """
    p = f"{NAME}."
    if f"{p}attention.key_length_mla" not in g.fields or "blk.0.attn_kv_b.weight" in (
        g.tensors
    ):
        raise UnsupportedError(
            f"{g.path}: a legacy deepseek2 file (one attn_kv_b, no "
            f"{p}attention.key_length_mla); entrenar reads the split attn_k_b / "
            "attn_v_b llama.cpp's converter writes: convert the model again"
        )
    heads = meta_int(g, f"{p}attention.head_count")
    n_rot = meta_int(g, f"{p}rope.dimension_count")
    d_qk = meta_int(g, f"{p}attention.key_length_mla")
    if d_qk <= n_rot:
        raise FormatError(
            f"{g.path}: {p}attention.key_length_mla = {d_qk} is not over "
            f"{p}rope.dimension_count = {n_rot}"
        )
    q_rank = g.fields.get(f"{p}attention.q_lora_rank")
    emb = g.tensors.get("token_embd.weight")
    n_vocab = emb.shape[0] if emb is not None and len(emb.shape) == 2 else None
    n_layers = meta_int(g, f"{p}block_count")
    fields: dict[str, Any] = dict(
        vocab_size=meta_int(g, f"{p}vocab_size", n_vocab),
        hidden_size=meta_int(g, f"{p}embedding_length"),
        intermediate_size=meta_int(g, f"{p}feed_forward_length"),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=heads,
        rope_theta=meta_float(g, f"{p}rope.freq_base", 10000.0),
        rms_norm_eps=meta_float(g, f"{p}attention.layer_norm_rms_epsilon", 1e-6),
        tie_word_embeddings="output.weight" not in g.tensors,
        max_position_embeddings=meta_int(g, f"{p}context_length", 2048),
        q_lora_rank=None
        if q_rank is None or q_rank.value == 0
        else meta_int(g, f"{p}attention.q_lora_rank"),
        kv_lora_rank=meta_int(g, f"{p}attention.kv_lora_rank"),
        qk_nope_head_dim=d_qk - n_rot,
        qk_rope_head_dim=n_rot,
        v_head_dim=meta_int(g, f"{p}attention.value_length_mla"),
        first_k_dense_replace=count_key(g, f"{p}leading_dense_block_count", 0),
    )
    fields |= _expert_fields(g, p, n_layers)
    fields |= _rope_fields(g, p)
    fields |= family_fields(g, NAME, {*SWITCH_FIELDS, *EXTRA_FIELDS})
    family = fields.pop("_family")
    family = fields.pop("architecture", family)
    try:
        return nn.architecture(family).make_config(**fields)
    except (ConfigError, TypeError, ValueError) as e:
        raise FormatError(f"{g.path}: inconsistent {NAME}.* metadata: {e}") from None


def _expert_fields(g: GGUFFile, p: str, n_layers: int) -> dict[str, Any]:
    """The routing (``_family``: the family it implies, V2 or V3)."""
    count = g.fields.get(f"{p}expert_count")
    gating = g.fields.get(f"{p}expert_gating_func")
    kind = 1 if gating is None else gating.value  # llama.cpp's default: softmax
    if kind not in GATING.values():
        raise UnsupportedError(
            f"{g.path}: metadata {p}expert_gating_func = {kind!r}; entrenar routes "
            "DeepSeek by softmax (1, V2) or sigmoid (2, V3)"
        )
    v3 = kind == GATING["sigmoid"]
    out: dict[str, Any] = {"_family": "deepseek_v3" if v3 else "deepseek_v2"}
    if v3:
        out |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    else:
        out |= {"scoring_func": "softmax", "topk_method": "greedy"}
    if count is None or count.value == 0:
        return out | {"num_experts": 0, "first_k_dense_replace": n_layers}
    groups = meta_int(g, f"{p}expert_group_count", 1)
    used = meta_int(g, f"{p}expert_group_used_count", groups)
    if not v3 and used < groups:
        raise UnsupportedError(
            f"{g.path}: softmax routing with {p}expert_group_count = {groups} and "
            f"expert_group_used_count = {used}: llama.cpp ranks groups by the sum of "
            "their top two scores, which DeepSeek-V2's routing does not"
        )
    norm = g.fields.get(f"{p}expert_weights_norm")
    scale = expert_scale(g, f"{p}expert_weights_scale")
    return out | {
        "num_experts": meta_int(g, f"{p}expert_count"),
        "num_experts_per_tok": meta_int(g, f"{p}expert_used_count"),
        "moe_intermediate_size": meta_int(g, f"{p}expert_feed_forward_length"),
        "n_shared_experts": meta_int(g, f"{p}expert_shared_count"),
        "n_group": groups if v3 else 1,
        "topk_group": used if v3 else 1,
        "routed_scaling_factor": scale,
        "norm_topk_prob": bool(norm is not None and norm.value),
    }


def expert_scale(g: GGUFFile, key: str) -> float:
    """``{arch}.expert_weights_scale``: 1 where missing or 0 (llama.cpp's unset)."""
    f = g.fields.get(key)  # 0: unset (llama.cpp scales by neither 0 nor 1)
    return 1.0 if f is None or f.value == 0 else float(meta_float(g, key, 1.0))


def _rope_fields(g: GGUFFile, p: str) -> dict[str, Any]:
    """YaRN's fields (`yarn_fields`), or none."""
    kind = g.fields.get(f"{p}rope.scaling.type")
    name = "none" if kind is None else kind.value
    if name in ("none", ""):
        return {}
    if name != "yarn":
        raise UnsupportedError(
            f"{g.path}: metadata {p}rope.scaling.type = {name!r}; entrenar reads "
            "DeepSeek with yarn (or none)"
        )
    f = meta_float(g, f"{p}rope.scaling.factor", 1.0)
    a = meta_float(g, f"{p}rope.scaling.attn_factor", 1.0)
    log_mul = meta_float(g, f"{p}rope.scaling.yarn_log_multiplier", None)
    log_mul = log_mul or None  # 0: unset, as llama.cpp reads it
    return {
        "rope_type": "yarn",
        "rope_factor": f,
        "rope_original_max_position_embeddings": meta_int(
            g, f"{p}rope.scaling.original_context_length"
        ),
        "rope_beta_fast": meta_float(g, f"{p}rope.scaling.yarn_beta_fast", 32.0),
        "rope_beta_slow": meta_float(g, f"{p}rope.scaling.yarn_beta_slow", 1.0),
        **yarn_fields(f, a, log_mul),
    }


def expected_tensors(
    g: GGUFFile, config: DeepseekConfig
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (Hugging Face name, shape) of every tensor ``config`` implies."""
    shapes = per_layer_shapes(config)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    h, r = config.num_heads, config.kv_lora_rank
    for hf, name in gguf_tensor_names(config).items():
        if isinstance(name, tuple):  # (H, r, d_n), (H, d_v, r)
            out[name[0]] = (hf, (h, r, config.qk_nope_head_dim))
            out[name[1]] = (hf, (h, config.v_head_dim, r))
        else:
            out[name] = (hf, shapes[hf])
    return out


def load_deepseek_tree(
    g: GGUFFile,
    config: DeepseekMoeConfig,
    *,
    dtype: str,
    quantize: Quantize | None,
    release: Any,
    names: Mapping[str, Any] | None = None,
) -> tuple[Any, Params, Mapping[str, Any]]:
    """The tree of a checked file of unstacked layers, tensor by tensor.

    Every tensor is dequantized into ``dtype`` (a kept type included: the
    unstacked layers are read whole), then ``quantize`` applied. ``names``:
    Hugging Face name -> GGUF name (default `gguf_tensor_names`, ``deepseek2``'s;
    GLM-4.5's ``glm4moe`` gives its own).
    """
    config = dataclasses.replace(config, param_dtype=dtype)
    if names is None:  # deepseek2's own table
        assert isinstance(config, DeepseekConfig)
        names = gguf_tensor_names(config)
    shapes = per_layer_shapes(config)

    def one(name: str) -> np.ndarray:
        t = g.tensors[name]
        raw = g.raw(name)
        a = dequantize_ggml(raw, t.type_id, t.shape)
        release(raw)
        return a

    def value(hf: str) -> Any:
        name = names[hf]
        a = (
            join_kv_b(one(name[0]), one(name[1]))
            if isinstance(name, tuple)
            else one(name)
        )
        return jnp.asarray(a.reshape(shapes[hf]), dtype=dtype)

    def build(tree: Any, prefix: str) -> Any:
        if isinstance(tree, list):
            return [build(t, f"{prefix}{i}.") for i, t in enumerate(tree)]
        if isinstance(tree, dict):
            return {k: build(v, f"{prefix}{k}.") for k, v in tree.items()}
        return value(prefix[:-1])

    params = quantize_leaves(build(config.param_shapes(), ""), quantize)
    tokenizer = {k: f for k, f in g.fields.items() if k.startswith("tokenizer.")}
    return config, params, GGUFMetadata(tokenizer)


# ------------------------------------------------------------------- writing
def deepseek_keys(c: DeepseekConfig, kind_id: int) -> dict[str, GGUFField]:
    """The ``deepseek2.*`` keys of ``c`` (module docstring), as the converter's."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    p = f"{NAME}."
    r, dr = c.kv_lora_rank, c.qk_rope_head_dim
    new: dict[str, tuple[Any, GGUFValueType]] = {
        "vocab_size": (c.vocab_size, u32),
        "context_length": (c.max_position_embeddings, u32),
        "embedding_length": (c.hidden_size, u32),
        "feed_forward_length": (c.intermediate_size, u32),
        "block_count": (c.num_layers, u32),
        "attention.head_count": (c.num_heads, u32),
        "attention.head_count_kv": (1, u32),  # MLA: one shared latent
        "rope.freq_base": (c.rope_theta, f32),
        "attention.layer_norm_rms_epsilon": (c.rms_norm_eps, f32),
        "leading_dense_block_count": (c.first_k_dense_replace, u32),
        "attention.q_lora_rank": (c.q_lora_rank or 0, u32),
        "attention.kv_lora_rank": (r, u32),
        "attention.key_length": (r + dr, u32),
        "attention.value_length": (r, u32),
        "attention.key_length_mla": (c.qk_head_dim, u32),
        "attention.value_length_mla": (c.v_head_dim, u32),
        "rope.dimension_count": (dr, u32),
    }
    if c.num_experts:
        new |= {
            "expert_feed_forward_length": (c.expert_size, u32),
            "expert_count": (c.num_experts, u32),
            "expert_used_count": (c.num_experts_per_tok, u32),
            "expert_shared_count": (c.n_shared_experts, u32),
            "expert_weights_scale": (float(c.routed_scaling_factor), f32),
            "expert_gating_func": (GATING[c.scoring_func], u32),
        }
        if c.norm_topk_prob:
            new["expert_weights_norm"] = (True, GGUFValueType.BOOL)
        if c.topk_method == "noaux_tc" or c.n_group == 1:  # (V2's: not applied)
            groups, used = written_groups(c.n_group, c.topk_group)
            new["expert_group_count"] = (groups, u32)
            new["expert_group_used_count"] = (used, u32)
    if c.rope_type == "yarn":
        a, log_mul = yarn_keys(c)
        new |= {
            "rope.scaling.type": ("yarn", GGUFValueType.STRING),
            "rope.scaling.factor": (float(c.rope_factor), f32),
            "rope.scaling.original_context_length": (
                c.rope_original_max_position_embeddings,
                u32,
            ),
            "rope.scaling.yarn_beta_fast": (float(c.rope_beta_fast), f32),
            "rope.scaling.yarn_beta_slow": (float(c.rope_beta_slow), f32),
        }
        if a != 1.0:
            new["rope.scaling.attn_factor"] = (a, f32)
        if c.rope_attention_factor is not None:  # the converter's copy (unread)
            new["rope.scaling.yarn_attn_factor"] = (c.rope_attention_factor, f32)
        if log_mul is not None:
            new["rope.scaling.yarn_log_multiplier"] = (log_mul, f32)
    out = {p + k: GGUFField(v, t) for k, (v, t) in new.items()}
    out["general.file_type"] = GGUFField(kind_id, u32)
    return out


def written_groups(n_group: int, topk_group: int) -> tuple[int, int]:
    """``(expert_group_count, expert_group_used_count)`` as a file states them.

    Keeping every group (``topk_group >= n_group > 1``) is the routing of one
    group, and llama.cpp's loader asserts ``n_group_used < n_expert_groups`` when
    there are several: such a config is written as one group (its groups kept in
    ``entrenar.family``).

    >>> written_groups(8, 4), written_groups(4, 4), written_groups(1, 1)
    ((8, 4), (1, 1), (1, 1))
    """
    if n_group > 1 and topk_group >= n_group:
        return 1, 1
    return n_group, topk_group


def family_json(c: DeepseekConfig, switches: dict[str, Any]) -> str:
    """``entrenar.family``: the switches and `EXTRA_FIELDS` off their defaults.

    The groups are kept whenever the keys state other ones (`written_groups`).
    """
    defaults = {f.name: f.default for f in dataclasses.fields(c)}
    out = dict(switches, architecture=c.architecture)
    for name in EXTRA_FIELDS:
        if getattr(c, name) != defaults[name]:
            out[name] = getattr(c, name)
    if written_groups(c.n_group, c.topk_group) != (c.n_group, c.topk_group):
        out |= {"n_group": c.n_group, "topk_group": c.topk_group}
    return json.dumps(out)


def deepseek_layer_tensors(
    config: DeepseekMoeConfig,
    params: Params,
    kind: str,
    emb_kind: str,
    to_bytes: Any,
    names: Mapping[str, Any] | None = None,
    exp_kind: str | None = None,
) -> dict[str, tuple[Any, tuple[int, ...], str]]:
    """GGUF name -> ``(make bytes, shape, type)`` of every tensor of ``params``.

    ``to_bytes(w, kind, name)`` converts one array (`llama_gguf_write`);
    ``names`` as `load_deepseek_tree`'s. The routed experts' stacks
    (``ffn_{gate,up,down}_exps``) are written in ``exp_kind`` (None: ``kind``).
    """
    if names is None:  # deepseek2's own table
        assert isinstance(config, DeepseekConfig)
        names = gguf_tensor_names(config)
    flat: dict[str, Any] = {}

    def walk(tree: Any, prefix: str) -> None:
        if isinstance(tree, list):
            for i, t in enumerate(tree):
                walk(t, f"{prefix}{i}.")
        elif isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = tree

    walk(params, "")
    shapes = per_layer_shapes(config)
    missing = sorted(set(shapes) - set(flat))
    if missing:
        raise FormatError(f"params lack {missing[:3]} (config {config.architecture})")
    out: dict[str, tuple[Any, tuple[int, ...], str]] = {}
    for hf, name in names.items():
        w, shape = flat[hf], shapes[hf]
        if isinstance(name, tuple):  # kv_b_proj: (H, r, d_n) and (H, d_v, r)
            assert isinstance(config, DeepseekConfig)  # (MLA's only)
            for j, n in enumerate(name):
                part = _kv_b_part(w, config, j, kind, to_bytes, hf)
                out[n] = (part, kv_b_shapes(config)[j], kind)
            continue
        table = hf in GLOBAL and len(shape) == 2
        k = (emb_kind if table else kind) if len(shape) >= 2 else "F32"
        k = "F32" if name.endswith(F32_NAMES) else k
        if exp_kind is not None and EXPERT_STACK.search(name):
            k = exp_kind
        out[name] = (_part(w, k, to_bytes, hf), tuple(shape), k)
    return out


def _part(w: Any, kind: str, to_bytes: Any, name: str) -> Any:
    def make() -> np.ndarray:
        return np.ascontiguousarray(to_bytes(w, kind, name)).reshape(-1)

    return make


def _kv_b_part(
    w: Any, c: DeepseekConfig, j: int, kind: str, to_bytes: Any, name: str
) -> Any:
    def make() -> np.ndarray:
        part = split_kv_b(np.asarray(to_dense(w), np.float32), c)[j]
        return np.ascontiguousarray(to_bytes(np.ascontiguousarray(part), kind, name))

    return make


def kv_b_shapes(c: DeepseekConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(k_b, v_b)`` numpy shapes."""
    h, r = c.num_heads, c.kv_lora_rank
    return (h, r, c.qk_nope_head_dim), (h, c.v_head_dim, r)


def row_widths(c: DeepseekConfig) -> tuple[int, ...]:
    """The row lengths of every matrix, for a quantized type's 32-value blocks."""
    widths = {c.hidden_size, c.kv_lora_rank, c.qk_nope_head_dim,
              c.num_heads * c.v_head_dim, c.intermediate_size}  # fmt: skip
    if c.q_lora_rank:
        widths.add(c.q_lora_rank)
    if c.num_experts:
        widths |= {c.expert_size, c.expert_size * c.n_shared_experts}
    return tuple(sorted(widths))


__all__ = [
    "GLOBAL",
    "KV_B",
    "LAYER",
    "NAME",
    "check_deepseek_gguf",
    "count_key",
    "deepseek_config_from_gguf",
    "deepseek_family",
    "expected_tensors",
    "expert_scale",
    "gguf_tensor_names",
    "join_kv_b",
    "load_deepseek_tree",
    "split_kv_b",
    "yarn_fields",
    "yarn_keys",
]
