"""gpt-oss (OpenAI's gpt-oss-20b / 120b, 2025): a mixture of experts with sinks.

A `LlamaConfig` (``architecture="gpt_oss"``) with, on top of Llama (transformers
5.25's ``modeling_gpt_oss.py`` is the reference):

- attention sinks: a learned logit per query head in each softmax's denominator
  (``self_attn.sinks (L, H)``, `entrenar.nn.attention`);
- layers alternating ``sliding_attention`` (window 128) and ``full_attention``
  (``layer_types``; by default layer ``i`` slides when ``i`` is even);
- YaRN rotary scaling, factor 32 from 4096 positions, ``truncate: false`` (the
  correction range is not rounded: `LlamaConfig.rope_truncate`);
- biases on q, k, v and o_proj; ``head_dim`` 64 whatever ``hidden_size``;
- a router with a bias, top-``k`` of its logits and a softmax over those ``k``
  (the renormalised top-``k`` softmax: `entrenar.nn.moe.route`);
- experts with biases and a clamped SwiGLU (`entrenar.nn.moe.clamped_swiglu`,
  ``swiglu_limit`` 7, ``α`` 1.702);
- Switch load-balancing auxiliary loss as transformers' (``output_router_logits``,
  ``router_aux_loss_coef``).

Checkpoint names (transformers' ``save_pretrained`` and the Hub's)::

    model.layers.{i}.self_attn.sinks                    (H,)
    model.layers.{i}.mlp.router.{weight (E, D), bias (E,)}
    model.layers.{i}.mlp.experts.gate_up_proj           (E, D, 2I)  x @ W layout,
    model.layers.{i}.mlp.experts.gate_up_proj_bias      (E, 2I)     gate = even
    model.layers.{i}.mlp.experts.down_proj              (E, I, D)   columns, up =
    model.layers.{i}.mlp.experts.down_proj_bias         (E, D)      odd ones

and in the Hub's MXFP4 files, for ``gate_up_proj`` and ``down_proj``, ``*_blocks
(E, out, in / 32, 16)`` and ``*_scales (E, out, in / 32)`` uint8 in the ``(out,
in)`` layout (`entrenar.nn.mxfp4`). `gpt_oss_from_hf_tensors` reads any of them
into the tree's ``mlp.gate`` (the router) and ``mlp.experts.{gate,up,down}_proj.
{weight (E, out, in), bias (E, out)}``, lazily (`Derived`: made when the load
copies the leaf); `gpt_oss_to_hf_tensors` writes transformers' float form.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from entrenar.errors import FormatError, UnsupportedError
from entrenar.nn.decoder_config import (
    TINY_SIZES,
    common_from_hf,
    common_to_hf,
    register_family,
)
from entrenar.nn.llama import LlamaConfig
from entrenar.nn.moe_families import Derived
from entrenar.nn.mxfp4 import dequantize_hf
from entrenar.nn.weight_node import to_dense

DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""transformers' `GptOssConfig` rope when the file gives none."""

HF_DEFAULTS = {
    "head_dim": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "sliding_window": 128,
}
"""transformers' `GptOssConfig` defaults that differ from the other families'."""


def _bf16() -> np.dtype:
    """bfloat16 as a NumPy dtype: MXFP4's values, exactly (`entrenar.nn.mxfp4`)."""
    return np.dtype(ml_dtypes.bfloat16)


# ------------------------------------------------------------ config.json fields
def gpt_oss_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: gpt_oss`` ``config.json`` as a `LlamaConfig`.

    transformers' defaults where a key is missing (`GptOssConfig`): the YaRN rope
    above, base 150000, ``layer_types`` sliding on even layers, window 128.
    ``quantization_config`` (the Hub's MXFP4) is the tensors' business
    (`gpt_oss_from_hf_tensors`); another ``quant_method`` is refused.

    Raises:
        UnsupportedError: a quantization other than MXFP4.
    """
    quant = hf.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
    if quant and method != "mxfp4":
        raise UnsupportedError(
            f"config.json: quantization_config {quant!r} is not supported for "
            "gpt_oss; entrenar reads float and MXFP4 (quant_method mxfp4) files"
        )
    hf = {**HF_DEFAULTS, **hf}
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf["rope_scaling"] = DEFAULT_ROPE
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    window = hf.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise UnsupportedError(
            "config.json: layer_types has sliding layers but sliding_window is null"
        )
    bias = bool(hf.get("attention_bias", True))
    k = hf.get("num_experts_per_tok", hf.get("experts_per_token", 4))
    return LlamaConfig(
        **common_from_hf(hf, "config.json", default_theta=150000.0),
        architecture="gpt_oss",
        attention_bias=bias,
        attention_out_bias=bias,
        sliding_window=None if window is None else int(window),
        layer_types=tuple(types),
        num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 128))),
        num_experts_per_tok=int(k),
        norm_topk_prob=True,
        moe_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        attention_sinks=True,
        output_router_logits=bool(hf.get("output_router_logits", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def gpt_oss_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a gpt-oss `LlamaConfig` (transformers' keys).

    Raises:
        UnsupportedError: a gpt-oss feature switched off (no config.json form).
    """
    needed = {"num_experts": c.num_experts > 0, "norm_topk_prob": c.norm_topk_prob,
              "moe_bias": c.moe_bias, "attention_sinks": c.attention_sinks,
              "swiglu_limit": c.swiglu_limit is not None}  # fmt: skip
    off = sorted(k for k, v in needed.items() if not v)
    if off:
        raise UnsupportedError(
            f"gpt-oss's config.json always has {sorted(needed)}; LlamaConfig has "
            f"{off} off"
        )
    allowed = ("rope_type", "attention_bias", "attention_out_bias", "sliding_window",
               "layer_types", "num_experts", "moe_bias", "swiglu_limit",
               "attention_sinks")  # fmt: skip
    hf = common_to_hf(c, "GptOssForCausalLM", "gpt_oss", allowed)
    hf["intermediate_size"] = c.expert_size
    hf.update(
        sliding_window=c.sliding_window,
        layer_types=list(c.layer_types or ("full_attention",) * c.num_layers),
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        swiglu_limit=c.swiglu_limit,
        swiglu_alpha=c.swiglu_alpha,
        output_router_logits=c.output_router_logits,
        router_aux_loss_coef=c.router_aux_loss_coef,
    )
    return hf


# ------------------------------------------------------------- tensor names
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.(router|experts)\.(.+)$")


def _gate_up(fused: Any, parity: int, bias: bool) -> np.ndarray:
    """Gate (``parity`` 0) or up (1) of a float ``gate_up_proj``: ``(E, I, D)``."""
    a = np.asarray(fused)
    if bias:  # (E, 2I) -> (E, I)
        return a[:, parity::2]
    return np.swapaxes(a[:, :, parity::2], 1, 2)  # (E, D, 2I) -> (E, I, D)


def _swap(a: Any) -> np.ndarray:
    """``(E, a, b)`` -> ``(E, b, a)``."""
    return np.swapaxes(np.asarray(a), 1, 2)


def _mxfp4(
    blocks: Any, scales: Any, name: str, rows: slice | None = None
) -> np.ndarray:
    """MXFP4 ``(E, out, G, 16)`` blocks -> bfloat16 ``(E, out, 32 G)`` (rows kept).

    Raises:
        FormatError: scales out of range (`dequantize_hf`), naming ``name``.
    """
    b, s = np.asarray(blocks), np.asarray(scales)
    if rows is not None:
        b, s = b[:, rows], s[:, rows]
    try:
        return dequantize_hf(b, s, _bf16())
    except FormatError as e:
        raise FormatError(f"{name}: {e}") from None


def _check_pair(name: str, blocks: Any, scales: Any, shape: tuple[int, ...]) -> None:
    """Raise `FormatError` unless the blocks and scales hold ``(E, out, in)``."""
    e, out, fan_in = shape
    want_b, want_s = (e, out, fan_in // 32, 16), (e, out, fan_in // 32)
    got_b, got_s = tuple(np.shape(blocks)), tuple(np.shape(scales))
    for part, x in (("blocks", blocks), ("scales", scales)):
        dtype = np.dtype(getattr(x, "dtype", None))
        if dtype != np.uint8:
            raise FormatError(
                f"{name}_{part} is {dtype}: MXFP4 blocks and scales are uint8 "
                "bytes; the checkpoint is corrupt"
            )
    if got_b != want_b or got_s != want_s:
        raise FormatError(
            f"{name}_blocks {got_b} / {name}_scales {got_s}: MXFP4 experts of "
            f"shape (E, out, in) = {shape} are stored as {want_b} and {want_s}; "
            "the checkpoint does not match the config"
        )


def gpt_oss_from_hf_tensors(
    flat: Mapping[str, Any], config: LlamaConfig
) -> dict[str, Any]:
    """A gpt-oss checkpoint's tensors under the tree's names (module docstring).

    Raises:
        FormatError: MXFP4 blocks without their scales, or of the wrong shape.
    """
    out: dict[str, Any] = {}
    layers: dict[int, dict[str, Any]] = {}
    for name, value in flat.items():
        m = _EXPERTS.match(name)
        if m is None:
            out[name] = value
        elif m.group(2) == "router":
            out[f"model.layers.{m.group(1)}.mlp.gate.{m.group(3)}"] = value
        else:
            layers.setdefault(int(m.group(1)), {})[m.group(3)] = value
    e, i, d = config.num_experts, config.expert_size, config.hidden_size
    bf16 = _bf16()
    for layer, rest in layers.items():
        p = f"model.layers.{layer}.mlp.experts"
        for key in ("gate_up_proj", "down_proj"):
            if f"{key}_blocks" in rest or f"{key}_scales" in rest:
                blocks = rest.pop(f"{key}_blocks", None)
                scales = rest.pop(f"{key}_scales", None)
                if blocks is None or scales is None:
                    raise FormatError(
                        f"{p}.{key}: MXFP4 {key}_blocks and {key}_scales come in "
                        "pairs; the checkpoint holds one of them"
                    )
                shape = (e, 2 * i, d) if key == "gate_up_proj" else (e, d, i)
                _check_pair(f"{p}.{key}", blocks, scales, shape)
                if key == "down_proj":
                    out[f"{p}.down_proj.weight"] = Derived(
                        [blocks, scales], (e, d, i), bf16,
                        lambda b, s, n=f"{p}.down_proj": _mxfp4(b, s, n),
                    )  # fmt: skip
                    continue
                for proj, parity in (("gate_proj", 0), ("up_proj", 1)):
                    out[f"{p}.{proj}.weight"] = Derived(
                        [blocks, scales], (e, i, d), bf16,
                        lambda b, s, r=slice(parity, None, 2), n=f"{p}.{key}": (
                            _mxfp4(b, s, n, r)
                        ),
                    )  # fmt: skip
            elif key in rest:
                w = rest.pop(key)
                if key == "down_proj":  # (E, I, D) -> (E, D, I)
                    out[f"{p}.down_proj.weight"] = Derived(
                        [w], (e, d, i), w.dtype, _swap
                    )
                    continue
                for proj, parity in (("gate_proj", 0), ("up_proj", 1)):
                    out[f"{p}.{proj}.weight"] = Derived(
                        [w], (e, i, d), w.dtype,
                        lambda a, q=parity: _gate_up(a, q, False),
                    )  # fmt: skip
        if "gate_up_proj_bias" in rest:
            bias = rest.pop("gate_up_proj_bias")
            for proj, parity in (("gate_proj", 0), ("up_proj", 1)):
                out[f"{p}.{proj}.bias"] = Derived(
                    [bias], (e, i), bias.dtype, lambda a, q=parity: _gate_up(a, q, True)
                )
        if "down_proj_bias" in rest:
            out[f"{p}.down_proj.bias"] = rest.pop("down_proj_bias")
        for left, value in rest.items():  # unknown: named as stored
            out[f"{p}.{left}"] = value
    return out


def _interleave(gate: Any, up: Any) -> jax.Array:
    """``[g0, u0, g1, u1, ...]`` along the last axis of two ``(..., I)`` arrays."""
    return jnp.stack([gate, up], axis=-1).reshape(*jnp.shape(gate)[:-1], -1)


def gpt_oss_to_hf_tensors(
    made: Mapping[str, Callable[[], Any]], config: LlamaConfig
) -> dict[str, Callable[[], Any]]:
    """``{name: make}`` under transformers' gpt-oss names (float experts).

    A layer's gate and up stacks are made dense (a LoRA adapter folded, a quantized
    base dequantized), interleaved and transposed to ``gate_up_proj (E, D, 2I)``
    (traceable: a writer may take the shapes by `jax.eval_shape`).
    """
    out: dict[str, Callable[[], Any]] = {}
    layers: dict[int, dict[str, Callable[[], Any]]] = {}
    pattern = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|experts)\.(.+)$")
    for name, make in made.items():
        m = pattern.match(name)
        if m is None:
            out[name] = make
        elif m.group(2) == "gate":
            out[f"model.layers.{m.group(1)}.mlp.router.{m.group(3)}"] = make
        else:
            layers.setdefault(int(m.group(1)), {})[m.group(3)] = make
    for layer, parts in layers.items():
        p = f"model.layers.{layer}.mlp.experts"
        out[f"{p}.gate_up_proj"] = functools.partial(_hf_gate_up, parts, "weight")
        out[f"{p}.gate_up_proj_bias"] = functools.partial(_hf_gate_up, parts, "bias")
        out[f"{p}.down_proj"] = functools.partial(_hf_down, parts)
        out[f"{p}.down_proj_bias"] = parts["down_proj.bias"]
    return out


def _dense_of(parts: Mapping[str, Callable[[], Any]], key: str) -> jax.Array:
    return jnp.asarray(to_dense(parts[key]()))


def _hf_gate_up(parts: Mapping[str, Callable[[], Any]], leaf: str) -> jax.Array:
    """The Hugging Face ``gate_up_proj (E, D, 2I)``, or its bias ``(E, 2I)``."""
    g, u = _dense_of(parts, f"gate_proj.{leaf}"), _dense_of(parts, f"up_proj.{leaf}")
    if leaf == "weight":  # (E, I, D) -> (E, D, I)
        g, u = jnp.swapaxes(g, 1, 2), jnp.swapaxes(u, 1, 2)
    return _interleave(g, u)


def _hf_down(parts: Mapping[str, Callable[[], Any]]) -> jax.Array:
    """The Hugging Face ``down_proj (E, I, D)``."""
    return jnp.swapaxes(_dense_of(parts, "down_proj.weight"), 1, 2)


# -------------------------------------------------------------------- family
FAMILY_DEFAULTS = dict(
    num_experts=32, num_experts_per_tok=4, moe_bias=True, swiglu_limit=7.0,
    attention_sinks=True, attention_bias=True, attention_out_bias=True, head_dim=64,
)  # fmt: skip
"""A from-scratch gpt-oss model's switches (`Architecture.make_config`)."""


def _tiny_gpt_oss() -> LlamaConfig:
    """Every gpt-oss feature on, at the conformance tests' sizes.

    Sinks, sliding / full layers, YaRN untruncated, biases, top-2 of 4 biased
    experts with the clamped SwiGLU (a limit of 0.5, which the tiny model reaches).
    """
    return LlamaConfig(
        **{**TINY_SIZES, "intermediate_size": 24},
        architecture="gpt_oss",
        rope_theta=150000.0,
        rope_type="yarn",
        rope_factor=32.0,
        rope_original_max_position_embeddings=64,
        rope_truncate=False,
        rms_norm_eps=1e-5,
        attention_bias=True,
        attention_out_bias=True,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_bias=True,
        swiglu_limit=0.5,
        attention_sinks=True,
    )


register_family(
    LlamaConfig,
    "gpt_oss",
    "gpt-oss: attention sinks, sliding / full layers, YaRN, a biased top-k mixture "
    "of clamped-SwiGLU experts",
    hf_class="GptOssForCausalLM",
    from_hf=gpt_oss_from_hf,
    to_hf=gpt_oss_to_hf,
    tiny=_tiny_gpt_oss,
    gguf_name="gpt-oss",
    defaults=FAMILY_DEFAULTS,
    from_hf_tensors=gpt_oss_from_hf_tensors,
    to_hf_tensors=gpt_oss_to_hf_tensors,
)

__all__ = [
    "DEFAULT_ROPE",
    "gpt_oss_from_hf",
    "gpt_oss_from_hf_tensors",
    "gpt_oss_to_hf",
    "gpt_oss_to_hf_tensors",
]
