"""IBM Granite 3.x MoE: Granite's multipliers around a top-k mixture of experts.

IBM, "Granite 3.0 Language Models", 2024 (granite-3.x-1b-a400m: 32 experts,
top-8; 3b-a800m: 40 experts, top-8). A `LlamaConfig` with
``architecture="granitemoe"``, as transformers 5.25's ``GraniteMoeForCausalLM``:
Granite's ``embedding_multiplier``, ``residual_multiplier``,
``attention_multiplier`` (the softmax scale) and ``logits_scaling``
(`entrenar.nn.granite`), and every MLP a sparse mixture (`entrenar.nn.moe`) of
``num_local_experts`` SwiGLU experts of width ``intermediate_size``. The router
takes the top ``k`` logits and a softmax over them, which is the renormalised
top-``k`` of the softmax (``norm_topk_prob``, always).

Checkpoint names. The Hub stores each layer's experts fused:
``model.layers.{i}.block_sparse_moe.input_linear.weight (E, 2I, D)`` (``[gate;
up]`` along the rows), ``output_linear.weight (E, D, I)`` and the router
``router.layer.weight (E, D)``; transformers 5.25's in-memory names are
``block_sparse_moe.experts.gate_up_proj``, ``experts.down_proj`` and
``router.weight``. `granitemoe_from_hf_tensors` reads either into the tree's
``mlp.gate`` and stacked ``mlp.experts.{gate,up,down}_proj.weight (E, out, in)``;
`granitemoe_to_hf_tensors` writes the Hub form.

``granitemoeshared`` (transformers' ``GraniteMoeSharedForCausalLM``, the Granite
MoE models with a shared expert) adds, when ``shared_intermediate_size`` ``S`` >
0, an ungated SwiGLU beside the experts: ``shared_mlp.input_linear.weight (2S, D)``
(``[gate; up]``) and ``shared_mlp.output_linear.weight (D, S)``, kept under those
names in the tree (`LlamaConfig.shared_mlp_intermediate_size`), so that LoRA on
them is PEFT's on the same modules. The layer's MLP output is ``MoE(x) +
shared_mlp(x)``, then scaled by ``residual_multiplier``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from entrenar.errors import UnsupportedError
from entrenar.nn.decoder_config import (
    TINY_SIZES,
    common_from_hf,
    common_to_hf,
    register_family,
)
from entrenar.nn.granite import MULTIPLIERS
from entrenar.nn.llama import LlamaConfig
from entrenar.nn.moe_families import Derived
from entrenar.nn.weight_node import to_dense

_SWITCHES = ("rope_type", "attention_bias", "attention_out_bias", "num_experts",
             *MULTIPLIERS)  # fmt: skip
_SHARED = "granitemoeshared"


def granitemoe_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: granitemoe`` or ``granitemoeshared`` ``config.json``."""
    bias = bool(hf.get("attention_bias", False))
    scales: dict[str, Any] = {
        k: 1.0 if hf.get(k) is None else float(hf[k]) for k in MULTIPLIERS
    }
    shared = hf.get("model_type") == _SHARED
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        **scales,
        architecture=_SHARED if shared else "granitemoe",
        shared_mlp_intermediate_size=(
            int(hf.get("shared_intermediate_size") or 0) if shared else 0
        ),
        attention_bias=bias,
        attention_out_bias=bias,
        num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 8))),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        norm_topk_prob=True,
        output_router_logits=bool(hf.get("output_router_logits", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def granitemoe_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Granite MoE `LlamaConfig` (None multipliers: 1.0).

    Raises:
        UnsupportedError: no experts, top-k weights not renormalised, or experts
            other than ``intermediate_size`` wide.
    """
    if not c.num_experts:
        raise UnsupportedError(
            "Granite MoE is a mixture of experts: num_experts must be > 0"
        )
    if not c.norm_topk_prob:
        raise UnsupportedError(
            "Granite MoE's router is a softmax over the top-k logits (renormalised): "
            "norm_topk_prob=False has no granitemoe config.json form"
        )
    if c.expert_size != c.intermediate_size:
        raise UnsupportedError(
            "Granite MoE's experts are intermediate_size wide: set "
            f"moe_intermediate_size None (it is {c.moe_intermediate_size})"
        )
    if c.architecture == _SHARED:
        hf = common_to_hf(
            c, "GraniteMoeSharedForCausalLM", _SHARED,
            (*_SWITCHES, "shared_mlp_intermediate_size"),
        )  # fmt: skip
        hf["shared_intermediate_size"] = c.shared_mlp_intermediate_size
    else:
        hf = common_to_hf(c, "GraniteMoeForCausalLM", "granitemoe", _SWITCHES)
    for key in MULTIPLIERS:
        value = getattr(c, key)
        hf[key] = 1.0 if value is None else value
    if c.attention_multiplier is None:  # transformers' 1.0 is not d^-1/2
        hf["attention_multiplier"] = c.hd**-0.5
    hf.update(
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        output_router_logits=c.output_router_logits,
        router_aux_loss_coef=c.router_aux_loss_coef,
        bos_token_id=None,  # the tokenizer's, written by entrenar.io
        eos_token_id=None,
        pad_token_id=None,
    )
    return hf


# ------------------------------------------------------------- tensor names
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.(.+)$")
_TREE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")
_GATE_UP = ("input_linear.weight", "experts.gate_up_proj")
_DOWN = ("output_linear.weight", "experts.down_proj")
_ROUTER = ("router.layer.weight", "router.weight")


def _half(stack: Any, which: int) -> np.ndarray:
    """Rows ``[0, I)`` (gate) or ``[I, 2I)`` (up) of a ``(E, 2I, D)`` stack."""
    a = np.asarray(stack)
    i = a.shape[1] // 2
    return a[:, which * i : (which + 1) * i]


def granitemoe_from_hf_tensors(
    flat: Mapping[str, Any], config: LlamaConfig
) -> dict[str, Any]:
    """A Granite MoE checkpoint's tensors under the tree's names (module docstring).

    The fused ``(E, 2I, D)`` stack becomes the gate's and the up projection's
    ``(E, I, D)``, each a `Derived` slice made when the load copies it.
    """
    out: dict[str, Any] = {}
    for name, value in flat.items():
        m = _BLOCK.match(name)
        if m is None:
            out[name] = value
            continue
        p, rest = f"model.layers.{m.group(1)}.mlp", m.group(2)
        if rest in _GATE_UP:
            e, two_i, d = np.shape(value)
            for which, proj in enumerate(("gate_proj", "up_proj")):
                out[f"{p}.experts.{proj}.weight"] = Derived(
                    [value], (e, two_i // 2, d), value.dtype,
                    functools.partial(_half, which=which),
                )  # fmt: skip
        elif rest in _DOWN:
            out[f"{p}.experts.down_proj.weight"] = value
        elif rest in _ROUTER:
            out[f"{p}.gate.weight"] = value
        else:  # not a tensor entrenar knows: named as stored
            out[name] = value
    return out


def _input_linear(gate: Callable[[], Any], up: Callable[[], Any]) -> Any:
    """The Hub's ``input_linear.weight (E, 2I, D)``: ``[gate; up]`` made dense."""
    g, u = jnp.asarray(to_dense(gate())), jnp.asarray(to_dense(up()))
    return jnp.concatenate([g, u], axis=1)


def granitemoe_to_hf_tensors(
    made: Mapping[str, Callable[[], Any]], config: LlamaConfig
) -> dict[str, Callable[[], Any]]:
    """``{name: make}`` under the Hub's Granite MoE names (fused expert stacks).

    A layer's gate and up stacks are made dense (a LoRA adapter folded, a
    quantized base dequantized) and concatenated when written.
    """
    out: dict[str, Callable[[], Any]] = {}
    layers: dict[str, dict[str, Callable[[], Any]]] = {}
    for name, make in made.items():
        m = _TREE.match(name)
        if m is None:
            out[name] = make
            continue
        layers.setdefault(m.group(1), {})[m.group(2)] = make
    for layer, parts in layers.items():
        p = f"model.layers.{layer}.block_sparse_moe"
        gate = parts.pop("experts.gate_proj.weight")
        up = parts.pop("experts.up_proj.weight")
        out[f"{p}.input_linear.weight"] = functools.partial(_input_linear, gate, up)
        out[f"{p}.output_linear.weight"] = parts.pop("experts.down_proj.weight")
        out[f"{p}.router.layer.weight"] = parts.pop("gate.weight")
        for rest, make in parts.items():  # not an expert tensor: named as in the tree
            out[f"model.layers.{layer}.mlp.{rest}"] = make
    return out


def _tiny() -> LlamaConfig:
    """Every multiplier away from 1, biases, linear rope, top-2 of 4 experts."""
    return LlamaConfig(
        **TINY_SIZES,
        architecture="granitemoe",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.2,
        logits_scaling=2.0,
        attention_bias=True,
        attention_out_bias=True,
        rope_type="linear",
        rope_factor=2.0,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )


def _tiny_shared() -> LlamaConfig:
    """The Granite MoE tiny with a shared expert 40 wide."""
    return dataclasses.replace(
        _tiny(), architecture=_SHARED, shared_mlp_intermediate_size=40
    )


register_family(
    LlamaConfig,
    "granitemoe",
    "Granite 3.x MoE: Granite's multipliers with a top-k mixture of experts",
    hf_class="GraniteMoeForCausalLM",
    from_hf=granitemoe_from_hf,
    to_hf=granitemoe_to_hf,
    tiny=_tiny,
    defaults={"num_experts": 8, "num_experts_per_tok": 2},
    from_hf_tensors=granitemoe_from_hf_tensors,
    to_hf_tensors=granitemoe_to_hf_tensors,
)
register_family(
    LlamaConfig,
    _SHARED,
    "Granite MoE shared: Granite MoE with an ungated shared expert beside the experts",
    hf_class="GraniteMoeSharedForCausalLM",
    from_hf=granitemoe_from_hf,
    to_hf=granitemoe_to_hf,
    tiny=_tiny_shared,
    in_gguf=False,  # written as granitemoe with ffn_*_shexp (gguf_families)
    defaults={"num_experts": 8, "num_experts_per_tok": 2},
    from_hf_tensors=granitemoe_from_hf_tensors,
    to_hf_tensors=granitemoe_to_hf_tensors,
)

__all__ = [
    "granitemoe_from_hf",
    "granitemoe_from_hf_tensors",
    "granitemoe_to_hf",
    "granitemoe_to_hf_tensors",
]
