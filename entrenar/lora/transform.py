"""LoRA as a tree rewrite: `apply`, `split` / `combine`, `trainable_mask`, dropout keys.

``apply`` replaces every weight a `LoRAConfig` selects by a `LoRAWeight` node; the rest
of the tree is returned unchanged (same objects). ``split`` partitions the result into a
trainable half (the adapters ``A``, ``B``) and a frozen half (everything else, bases
included); gradients are then taken with respect to the trainable half only::

    trainable, frozen = split(params)
    loss, grads = jax.value_and_grad(lambda t: loss_fn(combine(t, frozen)))(trainable)

Both halves keep the tree's structure, with ``None`` where the other half holds a leaf,
so optimizers (optax or entrenar.optim) run on ``trainable`` directly.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, UnsupportedError
from entrenar.lora import _quant
from entrenar.lora.config import LoRAConfig, frozen_linear, target_matches
from entrenar.lora.names import (
    STACKED_KEYS,
    hf_modules,
    named_weight_leaves,
    stacked_split,
)
from entrenar.lora.patterns import peft_pattern_value
from entrenar.lora.weight import LoRAWeight, eager_dora_norm, with_layer_ranks
from entrenar.nn.weight_node import is_weight_node, logical_shape
from entrenar.types import Params, PRNGKey


def _init_adapter(
    key: PRNGKey, shape: tuple[int, ...], config: LoRAConfig, r: Any = None
) -> tuple[jax.Array, jax.Array]:
    """``A (*lead, r, in)`` random and ``B (*lead, out, r)`` zero, in float32.

    ``r``: ``config.rank``, or each layer's rank ``(*lead,)`` (then ``A`` has the
    largest; its rows past a layer's rank are zeroed by `with_layer_ranks`).
    """
    *lead, out, fan_in = shape
    ranks = np.full(tuple(lead), config.rank) if r is None else np.asarray(r)
    big = int(ranks.max()) if ranks.size else config.rank
    a_shape = (*lead, big, fan_in)
    if config.init == "kaiming":  # PyTorch kaiming_uniform_(a=sqrt(5)): bound 1/√in
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
    elif r is None:  # "gaussian": N(0, 1/r²), PEFT's init_lora_weights="gaussian"
        a = jax.random.normal(key, a_shape, jnp.float32) / config.rank
    else:  # each layer N(0, 1/r_i²)
        per = jnp.asarray(ranks, jnp.float32)[..., None, None]  # (*lead, 1, 1)
        a = jax.random.normal(key, a_shape, jnp.float32) / per
    b = jnp.zeros((*lead, out, big), jnp.float32)
    return a, b


def module_ranks(
    name: str,
    shape: tuple[int, ...],
    config: LoRAConfig,
    stacked_keys: tuple[str, ...] = STACKED_KEYS,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Each module's ``(rank, alpha)`` under ``rank_pattern`` / ``alpha_pattern``.

    One value per Hugging Face module of the leaf (per layer of a stack), looked up
    as PEFT's ``get_pattern_key`` does (the first key that matches the end of the
    module name at a dot), else ``config.rank`` / ``config.alpha``.
    """
    modules = hf_modules(name, shape, stacked_keys)
    ranks = tuple(
        int(peft_pattern_value(config.rank_pattern, m, config.rank)) for m in modules
    )
    alphas = tuple(
        float(peft_pattern_value(config.alpha_pattern, m, config.alpha))
        for m in modules
    )
    return ranks, alphas


def selects(
    name: str,
    shape: tuple[int, ...],
    config: LoRAConfig,
    stacked_keys: tuple[str, ...] = STACKED_KEYS,
) -> bool:
    """Whether `apply` with ``config`` wraps the leaf ``name`` of logical ``shape``.

    Decides from the name and shape alone (no tree, nothing traced), as `apply`
    decides for each leaf: ``config.targets`` select all layers of a stack or none.

    Raises:
        UnsupportedError: a target selects only some layers of a stacked weight.
    """
    modules = hf_modules(name, shape, stacked_keys)
    if not modules:
        return False
    per_layer_ndim = len(shape) - (stacked_split(name, stacked_keys) is not None)
    hits = [
        any(target_matches(t, m, per_layer_ndim) for t in config.targets)
        for m in modules
    ]
    if any(hits) and not all(hits):
        chosen = [m for m, h in zip(modules, hits) if h]
        raise UnsupportedError(
            f"LoRA targets {config.targets} select only some layers of the stacked "
            f"weight {name!r} ({len(chosen)} of {len(modules)}, e.g. {chosen[0]!r}); "
            "stacked layers share one adapter shape: target all layers or none"
        )
    return all(hits)


def quantizes_untargeted(
    name: str,
    shape: tuple[int, ...],
    config: LoRAConfig,
    stacked_keys: tuple[str, ...] = STACKED_KEYS,
) -> bool:
    """Whether `apply` stores the leaf ``name`` 4-bit although no target adapts it.

    With ``config.quantize_untargeted`` (and a ``quantize_base`` scheme): a linear
    weight in `entrenar.lora.config.frozen_linear`'s sense that ``config.targets``
    do not select and the scheme's blocks divide (a weight they do not divide stays
    as it is: nothing asked for it by name). Decided from the name and shape alone.
    """
    if not config.quantize_untargeted or config.quantize_base == "none":
        return False
    modules = hf_modules(name, shape, stacked_keys)
    per_layer_ndim = len(shape) - (stacked_split(name, stacked_keys) is not None)
    if not modules or not all(frozen_linear(m, per_layer_ndim) for m in modules):
        return False
    return _quant.divides(shape, config.quantize_base)


def apply(
    params: Params,
    config: LoRAConfig,
    *,
    key: PRNGKey,
    quantize: str | None = None,
    stacked_keys: tuple[str, ...] = STACKED_KEYS,
) -> Params:
    """Wrap every weight ``config.targets`` select in a `LoRAWeight`.

    Args:
        params: parameter tree (weights ``(*lead, out, in)``; stacked layers allowed).
        config: rank, alpha (or per module: ``rank_pattern``, ``alpha_pattern``;
            the layers of a stack with different ranks are padded with zeros to
            the largest, see `entrenar.lora.weight.with_layer_ranks`), targets,
            dropout, init, rsLoRA, DoRA (``use_dora``:
            each node also gets ``magnitude = ‖W‖`` per output row, computed from
            the stored (quantized) base one layer at a time, so the adapted model
            starts equal to the base model, as in PEFT).
        key: random key for ``A`` (each weight gets ``fold_in(key, leaf_index)``).
        quantize: ``None``, ``"nf4"`` or ``"int4"``: store the frozen bases of the
            adapted weights as ``entrenar.quant.QuantizedWeight`` (QLoRA; NF4 uses
            double quantization). Bases already quantized are kept as they are.
            With ``config.quantize_untargeted`` also every other linear weight
            (`quantizes_untargeted`), as plain ``QuantizedWeight`` leaves.
        stacked_keys: the keys under which layers are stacked along axis 0.

    Returns:
        A new tree; the input is not modified.

    Raises:
        ConfigError: no weight matched, or a target is already a ``LoRAWeight``.
        UnsupportedError: a target selects only some layers of a stacked weight.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> p = {"q_proj": {"weight": jnp.ones((4, 3))}, "norm": jnp.ones(3)}
        >>> cfg = LoRAConfig(rank=2, alpha=4, targets="q_proj")
        >>> lp = apply(p, cfg, key=jax.random.key(0))
        >>> lp["q_proj"]["weight"].a.shape, lp["q_proj"]["weight"].b.shape
        ((2, 3), (4, 2))
    """
    if quantize not in (None, "nf4", "int4"):
        raise ConfigError(f"quantize must be None, 'nf4' or 'int4', got {quantize!r}")
    flat, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_weight_node)
    names = [n for n, _ in named_weight_leaves(params)]
    out, wrapped = [], 0
    for i, (name, leaf) in enumerate(zip(names, flat)):
        shape = logical_shape(leaf)
        if not selects(name, shape, config, stacked_keys):
            if quantize is not None and quantizes_untargeted(
                name, shape, config, stacked_keys
            ):  # no adapter, stored 4-bit (bitsandbytes' load_in_4bit)
                leaf = _quant.quantize_base(leaf, quantize, name)
            out.append(leaf)
            continue
        wrapped += 1
        if isinstance(leaf, LoRAWeight):
            raise ConfigError(
                f"{name!r} already has a LoRA adapter; merge it first (lora.fold)"
            )
        _refuse_expert_dropout(name, shape, config, stacked_keys)
        patterned = bool(config.rank_pattern or config.alpha_pattern)
        ranks, alphas = module_ranks(name, shape, config, stacked_keys)
        lead = shape[:-2]
        r = np.array(ranks).reshape(lead) if patterned else None
        a, b = _init_adapter(jax.random.fold_in(key, i), shape, config, r)
        base = leaf if quantize is None else _quant.quantize_base(leaf, quantize, name)
        node = LoRAWeight(
            base, a, b, config.alpha, a.shape[-2],
            rslora=config.rslora, dropout=config.dropout,
        )  # fmt: skip
        if patterned:  # one rank and alpha per module, padded within a stack
            node = with_layer_ranks(node, ranks, alphas)
        if config.use_dora:  # B = 0: ‖W + s·BA‖ = ‖W‖ (of the quantized base)
            node = node.replace(magnitude=eager_dora_norm(node))
        out.append(node)
    if not wrapped:
        raise ConfigError(_no_match_message(config.targets, names, flat))
    return jax.tree_util.tree_unflatten(treedef, out)


def _refuse_expert_dropout(
    name: str, shape: tuple[int, ...], config: LoRAConfig, stacked_keys: Any
) -> None:
    """Raise `UnsupportedError` for LoRA dropout on a stack of experts.

    An expert stack ``(E, out, in)`` is adapted through its weights: the routed
    grouped matmuls read ``W + s·B A`` (`entrenar.nn.moe`), so the adapter has no
    input of its own to drop. PEFT 0.21 refuses the same for the experts it adapts
    (``target_parameters``, ``ParamWrapper``: "does not work with lora_dropout !=
    0"), where attention would take it: entrenar once applied it there and
    skipped it on the experts, silently.
    """
    stacked = stacked_split(name, stacked_keys) is not None
    if config.dropout and len(shape) - int(stacked) > 2:
        raise UnsupportedError(
            f"LoRA dropout {config.dropout} on {name!r}, a stack of experts "
            f"{shape}: the experts' adapters are folded into their weights before "
            "the routed matmuls, so their input cannot be dropped (PEFT refuses "
            "lora_dropout with target_parameters too). Set dropout 0, or target "
            "only the linear modules (attention, dense MLPs)"
        )


def _no_match_message(targets: Any, names: list[str], flat: list[Any]) -> str:
    """Name the linear weights a target could match, and the closest to a typo."""
    examples: dict[str, str] = {}  # last module part -> one full module name
    for name, leaf in zip(names, flat):
        shape = logical_shape(leaf)
        stacked = stacked_split(name) is not None
        modules = hf_modules(name, shape)
        if modules and len(shape) - int(stacked) >= 2:  # a matrix per module
            examples.setdefault(modules[0].rsplit(".", 1)[-1], modules[0])
    wanted = [targets] if isinstance(targets, str) else list(targets)
    close = {
        t: difflib.get_close_matches(t, list(examples), n=1)
        for t in wanted
        if isinstance(t, str)
    }
    example = max(examples.values(), key=len, default="?")
    hints = "".join(f" Did you mean {m[0]!r} for {t!r}?" for t, m in close.items() if m)
    return (
        f"LoRA targets {targets} matched no weight. The linear weights here are "
        f"{', '.join(examples) or 'none'} (full names like {example!r}); a target "
        f"matches the last parts of a module name, or the whole name as a regex."
        f"{hints}"
    )


def split(params: Params) -> tuple[Params, Params]:
    """Partition into ``(trainable, frozen)``: adapters vs everything else.

    ``trainable`` holds ``LoRAWeight(base=None, a, b)`` nodes (with DoRA's
    ``magnitude``) and ``None`` elsewhere; ``frozen`` holds the other leaves and
    ``LoRAWeight(base, a=None, b=None, magnitude=None)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> p = {"w": LoRAWeight(jnp.ones((2, 2)), jnp.ones((1, 2)), jnp.zeros((2, 1)),
        ...      alpha=1, rank=1), "bias": jnp.zeros(2)}
        >>> t, f = split(p)
        >>> [x.shape for x in jax.tree_util.tree_leaves(t)]
        [(1, 2), (2, 1)]
    """
    nodes = jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, LoRAWeight)
    )
    if not any(isinstance(x, LoRAWeight) for x in nodes):
        raise ConfigError(
            "lora.split found no LoRA adapter in params, so nothing would train; "
            "add adapters first with lora.apply(params, LoRAConfig(...), key=...)"
        )

    def trainable(x: Any) -> Any:
        if isinstance(x, LoRAWeight):
            return x.replace(base=None, dropout_key=None, layer_scale=None)
        return None

    def frozen(x: Any) -> Any:
        if isinstance(x, LoRAWeight):
            return x.replace(a=None, b=None, magnitude=None)
        return x

    return (
        jax.tree_util.tree_map(trainable, params, is_leaf=is_weight_node),
        jax.tree_util.tree_map(frozen, params, is_leaf=is_weight_node),
    )


def combine(trainable: Params, frozen: Params) -> Params:
    """Inverse of `split`: ``combine(*split(p))`` is ``p``."""

    def pick(t: Any, f: Any) -> Any:
        if isinstance(f, LoRAWeight):
            if not isinstance(t, LoRAWeight):
                raise ConfigError(
                    "combine: the trainable tree has no adapter where the frozen tree "
                    "has a LoRAWeight; pass the halves of one lora.split"
                )
            return f.replace(a=t.a, b=t.b, magnitude=t.magnitude)
        return f if t is None else t

    return jax.tree_util.tree_map(
        pick, trainable, frozen, is_leaf=lambda x: x is None or is_weight_node(x)
    )


def trainable_mask(params: Params) -> Params:
    """Boolean tree (a prefix of ``params``): ``True`` exactly at adapter leaves.

    Usable as ``optax.masked(opt, trainable_mask(params))`` when optimizing the whole
    tree (`split` is cheaper: no gradients are formed for frozen weights).
    """

    def mask(x: Any) -> Any:
        if isinstance(x, LoRAWeight):
            key = None if x.dropout_key is None else False
            m = None if x.magnitude is None else True
            s = None if x.layer_scale is None else False
            return x.replace(
                base=False, a=True, b=True, dropout_key=key, magnitude=m, layer_scale=s
            )
        return False

    return jax.tree_util.tree_map(mask, params, is_leaf=is_weight_node)


def with_dropout_keys(params: Params, *, key: PRNGKey) -> Params:
    """Give every `LoRAWeight` with ``dropout > 0`` a fresh dropout key.

    Call once per training step (``key = jax.random.fold_in(root, step)``) on the
    frozen half or the full tree; a node whose ``dropout_key`` is ``None`` applies no
    dropout (evaluation). Stacked nodes get one key per layer, ``(*lead, 2)``.
    """
    if not jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    flat, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_weight_node)
    out = []
    for i, x in enumerate(flat):
        if isinstance(x, LoRAWeight) and x.dropout > 0.0:
            ref = x.base if x.base is not None else x.a
            lead = logical_shape(ref)[:-2]
            keys = jax.random.split(jax.random.fold_in(key, i), int(np.prod(lead)))
            data = jax.random.key_data(keys)  # (n, k) uint32
            x = x.replace(dropout_key=data.reshape(*lead, data.shape[-1]))
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


__all__ = [
    "apply",
    "combine",
    "module_ranks",
    "quantizes_untargeted",
    "split",
    "trainable_mask",
    "with_dropout_keys",
]
