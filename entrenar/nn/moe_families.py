"""Mixtral, Qwen3-MoE and Qwen1.5/2-MoE: decoders whose MLP is a sparse MoE.

Each is a `LlamaConfig` with ``num_experts > 0`` (`entrenar.nn.moe`):

- ``mixtral`` (Jiang et al., "Mixtral of Experts", 2024): Mistral's attention
  (``sliding_window`` possibly null), top-``k`` of ``num_local_experts`` experts,
  always renormalised.
- ``qwen3_moe`` (Qwen3, 2025): Qwen3's attention (per-head q/k RMSNorm), experts of
  width ``moe_intermediate_size``, renormalised when ``norm_topk_prob``.
- ``qwen2_moe`` (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's q/k/v biases, plus a shared
  expert behind a sigmoid gate.

Checkpoint names. The Hub (and transformers 5.25's ``save_pretrained``) store each
expert apart: ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen),
``model.layers.{i}.block_sparse_moe.experts.{e}.w{1,2,3}.weight`` with the router
``block_sparse_moe.gate.weight`` (Mixtral; w1 gate, w3 up, w2 down). transformers
5.25's in-memory ``state_dict`` fuses them: ``mlp.experts.gate_up_proj (E, 2I, D)``
(``[gate; up]``) and ``mlp.experts.down_proj (E, D, I)``. `moe_from_hf_tensors`
reads either into the tree's stacked ``mlp.experts.{gate,up,down}_proj.weight``
``(E, out, in)`` per layer; `moe_to_hf_tensors` writes the Hub form.

Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` (some layers dense) are refused:
one layer scan holds one MLP kind; every released Qwen MoE model has all layers
sparse.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import FormatError, UnsupportedError
from entrenar.nn.decoder_config import (
    TINY_SIZES,
    common_from_hf,
    common_to_hf,
    register_family,
)
from entrenar.nn.llama import LlamaConfig
from entrenar.nn.weight_node import to_dense

PROJS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
"""Mixtral's Hub names of an expert's projections."""


# ------------------------------------------------------------ config.json fields
def _experts_from_hf(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The `LlamaConfig` MoE fields of a Qwen MoE ``config.json``."""
    n = int(hf["num_hidden_layers"])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = sorted(
        {int(i) for i in hf.get("mlp_only_layers") or []}
        | {i for i in range(n) if (i + 1) % step}
    )
    if dense:
        raise UnsupportedError(
            f"{source}: layers {dense} have a dense MLP (decoder_sparse_step="
            f"{step}, mlp_only_layers={hf.get('mlp_only_layers')}); entrenar "
            "implements MoE models whose every layer is sparse (decoder_sparse_step "
            "1, mlp_only_layers [])"
        )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise FormatError(f"{source}: no num_experts in a {hf['model_type']} config")
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        **_aux_from_hf(hf),
    )


def _aux_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The load-balancing loss switch and weight (transformers' names)."""
    return dict(
        output_router_logits=bool(hf.get("output_router_logits", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _experts_to_hf(c: LlamaConfig) -> dict[str, Any]:
    return {
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "norm_topk_prob": c.norm_topk_prob,
        "moe_intermediate_size": c.expert_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": c.output_router_logits,
        "router_aux_loss_coef": c.router_aux_loss_coef,
    }


def _refuse_unrouted(c: LlamaConfig, family: str) -> None:
    if not c.num_experts:
        raise UnsupportedError(
            f"{family} is a mixture of experts: LlamaConfig.num_experts must be > 0"
        )


def mixtral_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: mixtral`` ``config.json`` as a `LlamaConfig`.

    ``router_jitter_noise`` (a training-time input jitter, 0 in Mixtral's own
    configs) is applied while training (`entrenar.nn.moe.router_jitter`).
    """
    window = hf.get("sliding_window")
    return LlamaConfig(
        **common_from_hf(hf, "config.json", default_theta=1e6),
        architecture="mixtral",
        sliding_window=None if window is None else int(window),
        num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 8))),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        norm_topk_prob=True,
        router_jitter_noise=float(hf.get("router_jitter_noise") or 0.0),
        **_aux_from_hf(hf),
    )


def mixtral_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Mixtral `LlamaConfig`."""
    _refuse_unrouted(c, "Mixtral")
    if not c.norm_topk_prob:
        raise UnsupportedError(
            "Mixtral always renormalises its top-k weights: norm_topk_prob=False "
            "has no Mixtral config.json form"
        )
    hf = common_to_hf(
        c, "MixtralForCausalLM", "mixtral",
        ("rope_type", "sliding_window", "num_experts", "router_jitter_noise"),
    )  # fmt: skip
    hf["intermediate_size"] = c.expert_size
    hf.update(
        sliding_window=c.sliding_window,
        num_local_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        output_router_logits=c.output_router_logits,
        router_aux_loss_coef=c.router_aux_loss_coef,
        router_jitter_noise=c.router_jitter_noise,
    )
    return hf


def qwen3_moe_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: qwen3_moe`` ``config.json`` (Qwen3-30B-A3B, ...)."""
    bias = bool(hf.get("attention_bias", False))
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        architecture="qwen3_moe",
        attention_bias=bias,
        attention_out_bias=bias,
        qk_norm=True,
        sliding_window=None if window is None else int(window),
        **_experts_from_hf(hf, "config.json"),
    )


def qwen3_moe_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Qwen3-MoE `LlamaConfig`."""
    _refuse_unrouted(c, "Qwen3-MoE")
    allowed = ("rope_type", "attention_bias", "attention_out_bias", "qk_norm",
               "sliding_window", "num_experts")  # fmt: skip
    hf = common_to_hf(c, "Qwen3MoeForCausalLM", "qwen3_moe", allowed)
    hf.update(_experts_to_hf(c))
    hf["use_sliding_window"] = c.sliding_window is not None
    hf["sliding_window"] = c.sliding_window
    return hf


def _qwen2_moe_windows(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE's sliding layers as transformers 5.25 reads them.

    Without ``layer_types``: layer ``i`` slides when ``i`` is even and below
    ``max_window_layers`` (`Qwen2MoeConfig`).
    """
    if not hf.get("use_sliding_window", False) or not hf.get("sliding_window"):
        return {}
    n = int(hf["num_hidden_layers"])
    below = int(hf.get("max_window_layers", 28))
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < below else "full_attention"
        for i in range(n)
    ]
    if "sliding_attention" not in types:
        return {}
    return {"sliding_window": int(hf["sliding_window"]), "layer_types": tuple(types)}


def qwen2_moe_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: qwen2_moe`` ``config.json`` (Qwen1.5-MoE, Qwen2-57B-A14B)."""
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        architecture="qwen2_moe",
        attention_bias=bool(hf.get("qkv_bias", True)),
        shared_expert_intermediate_size=int(
            hf.get("shared_expert_intermediate_size") or 0
        ),
        **_qwen2_moe_windows(hf),
        **_experts_from_hf(hf, "config.json"),
    )


def qwen2_moe_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Qwen2-MoE `LlamaConfig`."""
    _refuse_unrouted(c, "Qwen2-MoE")
    allowed = ("rope_type", "attention_bias", "sliding_window", "layer_types",
               "num_experts", "shared_expert_intermediate_size")  # fmt: skip
    hf = common_to_hf(c, "Qwen2MoeForCausalLM", "qwen2_moe", allowed)
    hf.update(_experts_to_hf(c))
    hf["qkv_bias"] = c.attention_bias
    hf["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
    if c.sliding_window is None:
        hf.update(use_sliding_window=False, layer_types=None)
    else:
        types = c.layer_types or ("sliding_attention",) * c.num_layers
        hf.update(
            use_sliding_window=True,
            sliding_window=c.sliding_window,
            max_window_layers=c.num_layers,
            layer_types=list(types),
        )
    return hf


# ------------------------------------------------------------- tensor names
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.(.+)$")


def _hub_expert(block: str, e: int, proj: str) -> str:
    """An expert projection's Hub name within a layer's block."""
    if block == "block_sparse_moe":
        return f"experts.{e}.{MIXTRAL_NAMES[proj]}.weight"
    return f"experts.{e}.{proj}.weight"


class Derived:
    """An array made from checkpoint tensors when read (gpt-oss's, `ExpertStack`).

    Stands for the made array in a load's ``flat`` dict: ``shape``, ``dtype``,
    ``nbytes``, indexing and ``np.asarray`` without reading ``parts`` until the
    load copies the leaf; ``drop`` (called by
    `entrenar.io.safetensors_io.release_pages`) forgets the made array.
    """

    def __init__(
        self,
        parts: list[Any],
        shape: tuple[int, ...],
        dtype: Any,
        make: Callable[..., np.ndarray],
    ) -> None:
        self.parts = parts
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self._make = make
        self._value: np.ndarray | None = None

    def value(self) -> np.ndarray:
        """The made array (kept until `drop`)."""
        value = self._value
        if value is None:
            value = np.ascontiguousarray(self._make(*self.parts))
            self._value = value
        return value

    def drop(self) -> None:
        """Forget the made array."""
        self._value = None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.value()
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, index: Any) -> np.ndarray:
        return self.value()[index]

    def __len__(self) -> int:
        return self.shape[0]


class ExpertStack(Derived):
    """``np.stack(parts)`` made when read: one layer's ``E`` experts ``(E, out, in)``.

    Stands for the stacked array in a load's ``flat`` dict (``shape``, ``dtype``,
    ``nbytes``, indexing, ``np.asarray``) without reading the parts until the load
    copies the leaf, so a load holds one layer's stack beside its final tree, not
    every layer's (`entrenar.io.safetensors_io.release_pages` releases the parts'
    mapped pages). The stack last made is kept for the reads of the same leaf that
    follow (the load asks its dtype, then copies it), until the load releases it
    (`drop`, called by `release_pages` once the layer is copied or quantized).

    The load quantizes layers on worker threads, so two stacks are made at once:
    the one kept is chosen under a lock, and every other is dropped. (Before, two
    workers could each drop the same previous stack and both keep theirs, and a
    stack kept so lived as long as the load's tensors: 11 of 24 stacks, 185 MB
    over a 108 MB tree, on a Qwen3-MoE folder of 8 layers x 16 experts.)
    """

    _last: ExpertStack | None = None
    _lock = threading.Lock()

    def __init__(self, parts: list[Any]) -> None:
        first = parts[0]
        shape = (len(parts), *np.shape(first))
        super().__init__(parts, shape, first.dtype, _stack)

    def value(self) -> np.ndarray:
        """The stacked array (made once; the previous stack kept is dropped)."""
        value = self._value
        if value is None:  # (a local: another thread may drop self._value meanwhile)
            value = self._make(*self.parts)  # (E, out, in)
            with ExpertStack._lock:
                last = ExpertStack._last
                if last is not None and last is not self:
                    last._value = None
                self._value = value
                ExpertStack._last = self
        return value

    def drop(self) -> None:
        """Forget the stack (made again if read again)."""
        with ExpertStack._lock:
            self._value = None
            if ExpertStack._last is self:
                ExpertStack._last = None


def _stack(*parts: Any) -> np.ndarray:
    """One layer's experts stacked: ``(E, out, in)``."""
    return np.stack([np.asarray(p) for p in parts])


def moe_from_hf_tensors(flat: Mapping[str, Any], config: LlamaConfig) -> dict[str, Any]:
    """A checkpoint's tensors with each layer's experts stacked (module docstring).

    Per layer ``i`` and projection: the ``E`` Hub tensors ``(out, in)`` become
    ``model.layers.{i}.mlp.experts.{proj}.weight (E, out, in)``, an `ExpertStack`
    read when the load copies it, or transformers' fused ``gate_up_proj`` is split.

    Raises:
        FormatError: a layer holds some of its experts but not all.
    """
    out: dict[str, Any] = {}
    groups: dict[tuple[int, str], dict[str, Any]] = {}
    for name, value in flat.items():
        m = _LAYER.match(name)
        if m is None:
            out[name] = value
            continue
        layer, block, rest = int(m.group(1)), m.group(2), m.group(3)
        if rest.startswith("experts."):
            groups.setdefault((layer, block), {})[rest] = value
        else:  # the router and Qwen2-MoE's shared expert keep their names
            out[f"model.layers.{layer}.mlp.{rest}"] = value
    e = config.num_experts
    for (layer, block), rest in groups.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        if "experts.gate_up_proj" in rest:  # transformers 5's in-memory form
            gate, up = np.split(np.asarray(rest.pop("experts.gate_up_proj")), 2, 1)
            out[f"{prefix}.gate_proj.weight"] = gate
            out[f"{prefix}.up_proj.weight"] = up
            out[f"{prefix}.down_proj.weight"] = rest.pop("experts.down_proj")
        for proj in PROJS:
            names = [_hub_expert(block, j, proj) for j in range(e)]
            have = [n for n in names if n in rest]
            if not have:
                continue
            if len(have) != e:
                missing = sorted(set(names) - set(have))[:3]
                raise FormatError(
                    f"layer {layer} has {len(have)} of its {e} experts' {proj}: "
                    f"missing model.layers.{layer}.{block}.{missing[0]}, ...; the "
                    "checkpoint does not match num_experts"
                )
            out[f"{prefix}.{proj}.weight"] = ExpertStack([rest.pop(n) for n in names])
        for left in rest:  # not an expert tensor entrenar knows: named as stored
            out[f"model.layers.{layer}.{block}.{left}"] = rest[left]
    return out


class _Dense:
    """A layer's stacked projection made dense once (traced calls never kept)."""

    def __init__(self, make: Callable[[], Any], experts: int) -> None:
        self.make = make
        self.experts = experts
        self.value: Any = None
        self.taken: set[int] = set()

    def expert(self, e: int) -> Any:
        """Expert ``e``'s ``(out, in)``; the dense copy goes once all were taken."""
        value = self.value
        if value is None:
            value = jnp.asarray(to_dense(self.make()))  # (E, out, in)
            if isinstance(value, jax.core.Tracer):  # shape tracing: keep nothing
                return value[e]
            self.value = value
        self.taken.add(e)
        if len(self.taken) == self.experts:
            self.value, self.taken = None, set()
        return value[e]


def moe_to_hf_tensors(
    made: Mapping[str, Callable[[], Any]], config: LlamaConfig, block: str = "mlp"
) -> dict[str, Callable[[], Any]]:
    """``{name: make}`` with each layer's experts as the Hub's per-expert tensors.

    ``block``: ``"block_sparse_moe"`` for Mixtral.

    A layer's stacked projection is made dense once (a LoRA adapter folded, a
    quantized base dequantized) and its ``E`` experts sliced from it: a writer
    that goes through the names in order holds one stacked projection at a time.
    """
    out: dict[str, Callable[[], Any]] = {}
    for name, make in made.items():
        m = _LAYER.match(name)
        if m is None or m.group(2) != "mlp":
            out[name] = make
            continue
        layer, rest = int(m.group(1)), m.group(3)
        proj = rest.removeprefix("experts.").removesuffix(".weight")
        if not rest.startswith("experts.") or proj not in PROJS:
            out[f"model.layers.{layer}.{block}.{rest}"] = make
            continue
        dense = _Dense(make, config.num_experts)
        for e in range(config.num_experts):
            hub = _hub_expert(block, e, proj)
            out[f"model.layers.{layer}.{block}.{hub}"] = functools.partial(
                dense.expert, e
            )
    return out


def mixtral_to_hf_tensors(
    made: Mapping[str, Callable[[], Any]], config: LlamaConfig
) -> dict[str, Callable[[], Any]]:
    """`moe_to_hf_tensors` under Mixtral's ``block_sparse_moe`` names."""
    return moe_to_hf_tensors(made, config, block="block_sparse_moe")


# -------------------------------------------------------------------- families
def _tiny_mixtral() -> LlamaConfig:
    """4 experts, top-2, a sliding window shorter than the tests' sequences."""
    return LlamaConfig(
        **TINY_SIZES,
        architecture="mixtral",
        sliding_window=4,
        num_experts=4,
        num_experts_per_tok=2,
    )


def _tiny_qwen3_moe() -> LlamaConfig:
    """q/k norms, biases, 4 experts of width 24, top-2 not renormalised."""
    return LlamaConfig(
        **TINY_SIZES,
        architecture="qwen3_moe",
        qk_norm=True,
        attention_bias=True,
        attention_out_bias=True,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        moe_intermediate_size=24,
    )


def _tiny_qwen2_moe() -> LlamaConfig:
    """q/k/v biases, top-3 of 4 renormalised, a shared expert, a sliding layer."""
    return LlamaConfig(
        **TINY_SIZES,
        architecture="qwen2_moe",
        attention_bias=True,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        num_experts=4,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
    )


register_family(
    LlamaConfig,
    "mixtral",
    "Mixtral: Mistral with a top-k mixture of SwiGLU experts",
    hf_class="MixtralForCausalLM",
    from_hf=mixtral_from_hf,
    to_hf=mixtral_to_hf,
    tiny=_tiny_mixtral,
    in_gguf=False,  # llama.cpp writes Mixtral as general.architecture "llama"
    defaults={"num_experts": 8, "num_experts_per_tok": 2},
    from_hf_tensors=moe_from_hf_tensors,
    to_hf_tensors=mixtral_to_hf_tensors,
)
register_family(
    LlamaConfig,
    "qwen3_moe",
    "Qwen3-MoE: Qwen3 with a top-k mixture of experts",
    hf_class="Qwen3MoeForCausalLM",
    from_hf=qwen3_moe_from_hf,
    to_hf=qwen3_moe_to_hf,
    tiny=_tiny_qwen3_moe,
    gguf_name="qwen3moe",
    defaults={"qk_norm": True, "num_experts": 8, "num_experts_per_tok": 2},
    from_hf_tensors=moe_from_hf_tensors,
    to_hf_tensors=moe_to_hf_tensors,
)
register_family(
    LlamaConfig,
    "qwen2_moe",
    "Qwen1.5/2-MoE: Qwen2 with a top-k mixture of experts and a shared expert",
    hf_class="Qwen2MoeForCausalLM",
    from_hf=qwen2_moe_from_hf,
    to_hf=qwen2_moe_to_hf,
    tiny=_tiny_qwen2_moe,
    gguf_name="qwen2moe",
    defaults={"attention_bias": True, "num_experts": 8, "num_experts_per_tok": 2},
    from_hf_tensors=moe_from_hf_tensors,
    to_hf_tensors=moe_to_hf_tensors,
)

__all__ = [
    "Derived",
    "ExpertStack",
    "mixtral_from_hf",
    "mixtral_to_hf",
    "moe_from_hf_tensors",
    "moe_to_hf_tensors",
    "qwen2_moe_from_hf",
    "qwen2_moe_to_hf",
    "qwen3_moe_from_hf",
    "qwen3_moe_to_hf",
]
