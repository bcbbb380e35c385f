"""Adapter files in Hugging Face PEFT's layout.

A folder with ``adapter_config.json`` (``peft_type: "LORA"``, ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, optional ``rank_pattern`` / ``alpha_pattern``) and
``adapter_model.safetensors`` holding, for each adapted module ``<m>`` (a Hugging Face
name, one per layer of a stacked weight)::

    base_model.model.<m>.lora_A.weight   (r, in)    float32
    base_model.model.<m>.lora_B.weight   (out, r)   float32

and for DoRA (``use_dora: true``, PEFT 0.21's names, no ``.weight`` suffix)::

    base_model.model.<m>.lora_magnitude_vector   (out,)   float32

so an adapter trained here loads with ``PeftModel.from_pretrained`` and one saved by
PEFT loads here. The language model of a vision-language checkpoint (``wrapper``:
``"gemma3"``, ``"qwen2_5_vl"``, ..., `entrenar.nn.multimodal`) names its modules as
PEFT names them on the ConditionalGeneration model
(``model.language_model.layers.0.self_attn.q_proj``; the legacy
``language_model.model.layers...``, Qwen2-VL's ``model.layers...``, is read too), and
its ``target_modules`` is a regex over the language model only, so that PEFT leaves
the vision tower alone.
`load_adapter` checks every name, shape and rank against the base
tree and reports everything that does not match in one `CompatibilityError`.
"""

from __future__ import annotations

import collections
import difflib
import json
import math
import os
import re
from typing import Any

import jax
import numpy as np

from entrenar.errors import (
    CompatibilityError,
    ConfigError,
    FormatError,
    UnsupportedError,
)
from entrenar.io.atomic import atomic_write
from entrenar.io.bounded import read_json
from entrenar.io.safetensors_io import read_safetensors, write_safetensors_stream
from entrenar.lora.config import LoRAConfig
from entrenar.lora.names import (
    STACKED_KEYS,
    hf_modules,
    named_weight_leaves,
    stacked_split,
)
from entrenar.lora.patterns import check_pattern, check_peft_key, peft_pattern_value
from entrenar.lora.peft_keys import check_peft_keys
from entrenar.lora.peft_moe import check_peft_loadable
from entrenar.lora.weight import LoRAWeight, eager_dora_norm, with_layer_ranks
from entrenar.nn import multimodal
from entrenar.nn.weight_node import is_weight_node, logical_shape
from entrenar.types import Params

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
_TENSOR = re.compile(
    r"base_model\.model\.(.+)\.(?:lora_([AB])(?:\.[A-Za-z0-9_\-]+)?\.weight"
    r"|lora_(magnitude)_vector)"
)
MAGNITUDE = "magnitude"
"""The part name of a DoRA magnitude tensor (beside ``"A"`` and ``"B"``)."""


def _untouched_magnitudes(x: LoRAWeight) -> np.ndarray:
    """Per layer: whether the magnitude is what a layer without adapter has.

    Always True for plain LoRA. For DoRA, ``m = ‖W + s·BA‖`` exactly (bit for bit,
    as `load_adapter` fills a layer the file has no tensors for): the layer's
    forward is the base's, so with ``A = B = 0`` it is left out of the file.
    """
    n = int(np.prod(x.a.shape[:-2]))
    if not x.dora:
        return np.ones(n, bool)
    m = np.asarray(x.magnitude, np.float32).reshape(n, -1)
    norm = np.asarray(eager_dora_norm(x), np.float32).reshape(n, -1)
    return (m == norm).all(axis=1)


def _adapted(params: Params, stacked_keys: tuple[str, ...]):
    """``(path, node, hf_module_names)`` for every `LoRAWeight` in the tree."""
    out = []
    for name, x in named_weight_leaves(params):
        if isinstance(x, LoRAWeight):
            out.append((name, x, hf_modules(name, logical_shape(x), stacked_keys)))
    return out


def check_saveable(
    params: Params,
    model_type: str | None = None,
    stacked_keys: tuple[str, ...] = STACKED_KEYS,
) -> None:
    """Refuse adapters no PEFT file holds as trained (before anything is written).

    A stack of experts' adapters (one A, B per expert), and adapters PEFT 0.21
    would drop when it loads the file for this ``model_type``
    (`entrenar.lora.peft_moe`).

    Raises:
        CompatibilityError: naming the module and what to do instead.
    """
    modules = []
    for name, x, names in _adapted(params, stacked_keys):
        if np.ndim(x.a) > 2 + (stacked_split(name, stacked_keys) is not None):
            raise CompatibilityError(
                f"save_adapter: {name} adapts a stack of experts (one A, B per "
                "expert); PEFT 0.21 adapts transformers' fused experts "
                "(target_parameters) with another parameterisation (one adapter on "
                "gate_up_proj), so no PEFT file holds it: merge it instead (export "
                "formats [hf] or [safetensors])"
            )
        modules += names
    check_peft_loadable(modules, model_type)


def save_adapter(
    params: Params,
    path: str | os.PathLike[str],
    *,
    base_model_name_or_path: str | None = None,
    task_type: str | None = "CAUSAL_LM",
    stacked_keys: tuple[str, ...] = STACKED_KEYS,
    config: LoRAConfig | None = None,
    wrapper: str | None = None,
    model_type: str | None = None,
) -> None:
    """Write the adapters of ``params`` to the folder ``path`` in PEFT's layout.

    Args:
        params: a tree with `LoRAWeight` nodes. Pass the full tree: then
            ``target_modules`` is checked against the modules without adapters
            (with `split`'s trainable half it is the list of name suffixes).
        path: output folder (created if missing); both files are written atomically.
        base_model_name_or_path: recorded in the config for PEFT.
        task_type: PEFT task type (``"CAUSAL_LM"``, or ``None`` for a custom model).
        stacked_keys: keys under which layers are stacked (layer ``i`` of a stacked
            weight is saved as ``...layers.{i}...``).
        config: the `LoRAConfig` the adapters were made with: when its ``rank``,
            ``alpha``, ``rank_pattern`` and ``alpha_pattern`` give every saved
            module its rank and alpha (PEFT's lookup), they are written as they
            are (as PEFT writes its config's); otherwise, and without it, ``r`` and
            ``lora_alpha`` are the most common values and the patterns name each
            module that differs (``re.escape`` of its name).
        wrapper: the vision-language ``model_type`` the model's language model
            was read from (``config.hf_wrapper``), or None (module docstring).
        model_type: the model's Hugging Face ``model_type``: adapters PEFT would
            drop when it loads this model type are refused (`peft_moe`).

    A layer whose A and B are both zero (one `load_adapter` filled in for a layer
    the file had no adapter for; for DoRA also ``m = ‖W‖`` exactly) is left out,
    and ``target_modules`` then names the adapted modules exactly, so PEFT adapts
    the same layers. DoRA adapters also write ``lora_magnitude_vector`` and
    ``use_dora: true``.

    Raises:
        CompatibilityError: no adapter in ``params`` (or only zero ones),
            adapters mix rsLoRA or DoRA settings, or PEFT would drop some
            (``model_type``).
    """
    folder = os.fspath(path)
    adapted = _adapted(params, stacked_keys)
    if not adapted:
        raise CompatibilityError("save_adapter: the tree has no LoRAWeight to save")
    if len({x.rslora for _, x, _ in adapted}) > 1:
        raise CompatibilityError(
            "PEFT stores one use_rslora for all adapters; got both"
        )
    if len({x.dora for _, x, _ in adapted}) > 1:
        raise CompatibilityError(
            "PEFT stores one use_dora for all adapters; got DoRA and plain LoRA "
            "adapters in one tree: save them as two adapters"
        )
    check_saveable(params, model_type, stacked_keys)
    tensors, ranks, alphas = {}, {}, {}
    for _, x, modules in adapted:
        a, b = np.asarray(x.a, np.float32), np.asarray(x.b, np.float32)
        mag = None if not x.dora else np.asarray(x.magnitude, np.float32)
        untouched = _untouched_magnitudes(x)
        stacked = a.ndim == 3
        layer_ranks, layer_alphas = x.real_ranks(), x.real_alphas()
        for i, m in enumerate(modules):
            ai, bi = (a[i], b[i]) if stacked else (a, b)
            if not ai.any() and not bi.any() and untouched[i]:
                continue  # a layer without adapter (load_adapter's zero layers)
            r_i = layer_ranks[i]  # the layer's own rank: padding left out
            tensors[f"{PREFIX}{m}.lora_A.weight"] = ai[:r_i]  # (r_i, in)
            tensors[f"{PREFIX}{m}.lora_B.weight"] = bi[:, :r_i]  # (out, r_i)
            if mag is not None:  # (out,), PEFT's name has no ".weight"
                tensors[f"{PREFIX}{m}.lora_magnitude_vector"] = (
                    mag[i] if stacked else mag
                )
            ranks[m], alphas[m] = r_i, layer_alphas[i]
    if wrapper is not None:  # PEFT's names on the ConditionalGeneration model
        tensors = {_peft_tensor(k): v for k, v in tensors.items()}
    if not ranks:
        raise CompatibilityError(
            "save_adapter: every adapter is zero (A = 0 and B = 0): nothing to save"
        )
    suffixes = sorted({m.rsplit(".", 1)[-1] for m in ranks})
    all_modules = {
        m
        for n, w in named_weight_leaves(params)
        for m in hf_modules(n, logical_shape(w), stacked_keys)
    }
    others = {m for m in all_modules - set(ranks) if m.rsplit(".", 1)[-1] in suffixes}
    targets: list[str] | str = suffixes
    if others:  # a suffix list would adapt more modules: name them exactly
        targets = "|".join(re.escape(m) for m in sorted(ranks))
    if wrapper is not None:
        targets = _wrapped_targets(sorted(ranks), suffixes, bool(others))
        ranks = {multimodal.peft_module(m): k for m, k in ranks.items()}
        alphas = {multimodal.peft_module(m): k for m, k in alphas.items()}
    r, alpha, rank_pattern, alpha_pattern = _patterns(ranks, alphas, config)
    written = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": adapted[0][1].dropout,
        "target_modules": targets,
        "use_rslora": adapted[0][1].rslora,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "use_dora": adapted[0][1].dora,
    }
    os.makedirs(folder, exist_ok=True)
    # tensor by tensor from the adapters' own buffers (no whole-file copy in memory)
    specs = {k: (v.dtype, v.shape) for k, v in tensors.items()}
    write_safetensors_stream(
        os.path.join(folder, WEIGHTS_NAME),
        specs,
        lambda name: (tensors[name],),
        {"format": "pt"},
    )
    with atomic_write(os.path.join(folder, CONFIG_NAME), "w") as f:
        f.write(json.dumps(written, indent=2))


def _peft_tensor(name: str) -> str:
    """``base_model.model.<text module>.<part>`` under PEFT's wrapped module name."""
    m = _TENSOR.fullmatch(name)
    assert m is not None
    module = m.group(1)
    rest = name[len(PREFIX) + len(module) :]
    return f"{PREFIX}{multimodal.peft_module(module)}{rest}"


def _wrapped_targets(modules: list[str], suffixes: list[str], exact: bool) -> str:
    """A vision-language model's ``target_modules``: a regex of its language model.

    PEFT fullmatches it against its module names; it picks the adapted
    language-model modules only (a suffix list would adapt the vision tower's
    ``q_proj`` too).

    ``exact``: name each module (other modules share the suffixes).
    """
    if exact:
        return "|".join(re.escape(multimodal.peft_module(m)) for m in modules)
    inner = [s for s in suffixes if any(m.endswith("." + s) for m in modules)]
    tails = "|".join(re.escape(s) for s in inner if s != "lm_head")
    parts = [rf"model\.language_model\..*\.(?:{tails})"] if tails else []
    if "lm_head" in modules:
        parts.append("lm_head")
    return "|".join(parts)


def _patterns(
    ranks: dict[str, int], alphas: dict[str, float], config: LoRAConfig | None
) -> tuple[int, float, dict[str, int], dict[str, float]]:
    """``(r, lora_alpha, rank_pattern, alpha_pattern)`` that give each module its own.

    ``config``'s when they do (PEFT's ``get_pattern_key`` lookup), else the most
    common rank and alpha and one escaped module name per module that differs.
    """
    if config is not None and all(
        peft_pattern_value(config.rank_pattern, m, config.rank) == ranks[m]
        and float(peft_pattern_value(config.alpha_pattern, m, config.alpha))
        == alphas[m]
        for m in ranks
    ):
        return (
            config.rank,
            config.alpha,
            dict(config.rank_pattern),
            dict(config.alpha_pattern),
        )
    r = collections.Counter(ranks.values()).most_common(1)[0][0]
    alpha = collections.Counter(alphas.values()).most_common(1)[0][0]
    return (
        r,
        alpha,
        {re.escape(m): k for m, k in ranks.items() if k != r},
        {re.escape(m): k for m, k in alphas.items() if k != alpha},
    )


MAX_CONFIG_BYTES = 16 << 20
"""Size limit of an ``adapter_config.json`` (16 MiB)."""


def _read_config(folder: str) -> dict[str, Any]:
    """The validated ``adapter_config.json`` of ``folder`` (`check_adapter_config`)."""
    file = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(file):
        raise FormatError(f"{file}: not found; an adapter folder needs {CONFIG_NAME}")
    cfg = read_json(file, max_bytes=MAX_CONFIG_BYTES, what="adapter config")
    check_adapter_config(cfg, file)
    return cfg


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _field(cfg: dict[str, Any], file: str, key: str, ok: bool, want: str) -> None:
    if not ok:
        raise FormatError(f"{file}: {key!r} = {cfg.get(key)!r:.60} must be {want}")


def check_adapter_config(cfg: Any, file: str) -> None:
    """Check a parsed ``adapter_config.json``: types, ranges and patterns.

    Raises:
        FormatError: not an object, or a field of the wrong type or out of range
            (``r`` a positive int, ``lora_alpha`` a finite number > 0,
            ``lora_dropout`` in [0, 1), patterns safe to run, see
            `entrenar.lora.patterns`); the message names the file and the key.
        UnsupportedError: another PEFT method, or a setting that changes PEFT's
            forward (`entrenar.lora.peft_keys`: LoRA variants, biases,
            ``modules_to_save``, PiSSA-like initialisations, unknown keys).
    """
    if not isinstance(cfg, dict):
        raise FormatError(
            f"{file}: must be a JSON object of PEFT settings, got {type(cfg).__name__}"
        )
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UnsupportedError(
            f"{file}: peft_type {cfg['peft_type']!r:.40}; only LORA is supported"
        )
    r, alpha, dropout = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("lora_dropout")
    _field(cfg, file, "r", type(r) is int and r > 0, "an integer > 0")
    _field(cfg, file, "lora_alpha", _positive(alpha), "a finite number > 0")
    _field(
        cfg,
        file,
        "lora_dropout",
        dropout is None or (_number(dropout) and 0 <= dropout < 1),
        "a number in [0, 1)",
    )
    use_rslora = cfg.get("use_rslora")
    _field(cfg, file, "use_rslora", use_rslora in (None, True, False), "true or false")
    use_dora = cfg.get("use_dora")
    _field(cfg, file, "use_dora", use_dora in (None, True, False), "true or false")
    check_peft_keys(cfg, file)
    _check_patterns(cfg, file, "rank_pattern", lambda v: type(v) is int and v > 0)
    _check_patterns(cfg, file, "alpha_pattern", _positive)
    _check_targets(cfg, file)


def _positive(x: Any) -> bool:
    return _number(x) and math.isfinite(x) and x > 0


def _check_patterns(cfg: dict[str, Any], file: str, key: str, valid: Any) -> None:
    """``rank_pattern`` / ``alpha_pattern``: ``{pattern: value}``, both checked."""
    patterns = cfg.get(key)
    if patterns is None:
        return
    _field(cfg, file, key, isinstance(patterns, dict), "an object {pattern: value}")
    for pattern, value in patterns.items():
        if not valid(value):
            want = "an integer > 0" if key == "rank_pattern" else "a number > 0"
            raise FormatError(
                f"{file}: {key}[{pattern!r:.60}] = {value!r:.40} must be {want}"
            )
        if not pattern:
            raise FormatError(f"{file}: {key} has an empty pattern")
        try:
            check_peft_key(pattern)
        except ConfigError as e:
            raise FormatError(f"{file}: {key}: {e}") from None


def _check_targets(cfg: dict[str, Any], file: str) -> None:
    """``target_modules``: a regex PEFT full-matches, or a list of name suffixes."""
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        try:
            check_pattern(targets)
        except ConfigError as e:
            raise FormatError(f"{file}: target_modules: {e}") from None
        return
    ok = targets is None or (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    )
    _field(cfg, file, "target_modules", ok, "a regex or a list of module names")


_pattern = peft_pattern_value


def load_adapter(
    path: str | os.PathLike[str],
    base_params: Params,
    *,
    stacked_keys: tuple[str, ...] = STACKED_KEYS,
    wrapper: str | None = None,
) -> Params:
    """Read a PEFT LoRA adapter folder and attach it to ``base_params``.

    Args:
        path: folder with ``adapter_config.json`` and ``adapter_model.safetensors``.
        base_params: the base model's tree (dense or quantized weights).
        stacked_keys: keys under which layers are stacked.
        wrapper: the vision-language ``model_type`` the base's language model was
            read from (``config.hf_wrapper``): the adapter's module names are
            PEFT's on the ConditionalGeneration model, in either key layout
            (module docstring); one on the vision tower or projector is refused.

    Returns:
        ``base_params`` with every adapted weight a `LoRAWeight` (adapters float32).

    Raises:
        FormatError: a missing, corrupt or malformed file, an adapter tensor
            holding NaN or Inf (named), or layer ranks whose zero padding over the
            stacked layers would be far larger than the file and the base weight
            (`_check_padding`).
        CompatibilityError: names, shapes or ranks that do not fit the base; the
            message lists every mismatch.
        UnsupportedError: a setting PEFT's forward depends on that entrenar does
            not implement (`entrenar.lora.peft_keys`).

    A stacked weight whose file has tensors for only some layers (PEFT's
    ``layers_to_transform``, ``layers_pattern``, ``exclude_modules``) gets zero
    adapters on the others, which `save_adapter` leaves out again.
    """
    folder = os.fspath(path)
    cfg = _read_config(folder)
    wfile = os.path.join(folder, WEIGHTS_NAME)
    if not os.path.isfile(wfile):
        raise FormatError(f"{wfile}: not found (adapter_model.bin is not read: pickle)")
    header, _ = read_safetensors(wfile)  # validated, memory-mapped
    problems: list[str] = []
    found = _group_by_module(header, problems)
    if wrapper is not None:
        found = _text_modules(found, wrapper, problems)
    flat, treedef = jax.tree_util.tree_flatten(base_params, is_leaf=is_weight_node)
    names = [n for n, _ in named_weight_leaves(base_params)]
    per_leaf = _place_modules(found, flat, names, cfg, stacked_keys, problems)
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        if any(_TENSOR.fullmatch(name) is None for name in header):
            more += (
                "\n(entrenar reads the lora_A / lora_B weights (and DoRA's "
                "lora_magnitude_vector) of linear modules; LoRA or DoRA on "
                "embeddings and whole layers saved beside the adapter are "
                "not supported: merge the adapter in PEFT with merge_and_unload and "
                "load the merged model)"
            )
        raise CompatibilityError(
            f"{folder}: adapter does not match the base model:\n  {shown}{more}"
        )
    out_leaves = list(flat)
    for k, layers in per_leaf.items():
        out_leaves[k] = _lora_leaf(
            flat[k], names[k], layers, found, cfg, stacked_keys, wfile
        )
    return jax.tree_util.tree_unflatten(treedef, out_leaves)


def _group_by_module(
    header: dict[str, Any], problems: list[str]
) -> dict[str, dict[str, Any]]:
    """``{PEFT module name: {"A": A, "B": B[, "magnitude": m]}}`` from the tensors.

    A module with two A (or B) tensors (``lora_A.weight`` and ``lora_A.other.weight``:
    two named adapters in one file) is a problem: which pairs with which is unknown.
    """
    found: dict[str, dict[str, Any]] = collections.defaultdict(dict)
    names: dict[tuple[str, str], str] = {}
    for name, info in header.items():
        m = _TENSOR.fullmatch(name)
        if m is None and ".lora_embedding_" in name:
            problems.append(
                f"tensor {name!r} adapts an embedding (lora_embedding_A/B): LoRA "
                "and DoRA on embeddings are not supported"
            )
            continue
        if m is None:
            problems.append(f"tensor {name!r} is not a LoRA A/B weight")
            continue
        key = (m.group(1), m.group(2) or MAGNITUDE)
        if key in names:
            problems.append(
                f"module {key[0]!r} has two lora_{key[1]} tensors, "
                f"{names[key]!r} and {name!r}; keep one adapter per file"
            )
            continue
        names[key] = name
        found[m.group(1)][key[1]] = info
    return found


def _text_modules(
    found: dict[str, dict[str, Any]], wrapper: str, problems: list[str]
) -> dict[str, dict[str, Any]]:
    """PEFT's module names on a ConditionalGeneration model as the text model's."""
    out: dict[str, dict[str, Any]] = {}
    vision = sorted(m for m in found if multimodal.is_vision(m, wrapper))
    if vision:
        problems.append(
            f"{len(vision)} modules adapt the {wrapper} vision tower or projector "
            f"({vision[0]!r}, ...), which entrenar does not load: train the adapter "
            "on the language model only (PEFT target_modules a regex such as "
            r"'model\.language_model\..*\.(?:q_proj|v_proj)')"
        )
    for mod, parts in found.items():
        if mod in vision:
            continue
        text = multimodal.text_module(mod, wrapper)
        if text is None:
            problems.append(
                f"module {mod!r} is not of the {wrapper} language model "
                "(model.language_model.*, lm_head, or the file's legacy names)"
            )
            continue
        out[text] = parts
    return out


def _place_modules(
    found: dict[str, dict[str, Any]],
    flat: list[Any],
    names: list[str],
    cfg: dict[str, Any],
    stacked_keys: tuple[str, ...],
    problems: list[str],
) -> dict[int, dict[int, str]]:
    """Where each adapted module goes: ``{leaf k: {layer j: module}}``.

    Appends to ``problems`` every module that is not in the base, lacks A or B, or
    does not fit the base weight's shape with its rank. A stacked leaf may have
    tensors for only some of its layers (PEFT's ``layers_to_transform``,
    ``exclude_modules``), and its layers may have different ranks.
    """
    dora = bool(cfg.get("use_dora", False))
    index: dict[str, tuple[int, int]] = {}  # PEFT module name -> (leaf, layer)
    for k, (n, x) in enumerate(zip(names, flat)):
        for j, mod in enumerate(hf_modules(n, logical_shape(x), stacked_keys)):
            index[mod] = (k, j)
    per_leaf: dict[int, dict[int, str]] = collections.defaultdict(dict)
    for mod, parts in sorted(found.items()):
        if mod not in index:
            near = difflib.get_close_matches(mod, list(index), n=1)
            hint = f" (closest base module: {near[0]!r})" if near else ""
            problems.append(f"module {mod!r} is not in the base model{hint}")
            continue
        if not {"A", "B"} <= set(parts):
            has = " and ".join(f"lora_{p}" for p in sorted(parts))
            problems.append(f"module {mod!r} has {has} only")
            continue
        if dora != (MAGNITUDE in parts):
            problems.append(
                f"module {mod!r} has no lora_magnitude_vector but the config says "
                "use_dora: true"
                if dora
                else f"module {mod!r} has a lora_magnitude_vector (DoRA) but the "
                "config does not say use_dora: true"
            )
            continue
        k, j = index[mod]
        out, fan_in = logical_shape(flat[k])[-2:]
        if isinstance(flat[k], LoRAWeight):
            problems.append(f"module {mod!r} already has an adapter in the base tree")
        a_shape, b_shape = parts["A"].shape, parts["B"].shape
        r = _pattern(cfg.get("rank_pattern") or {}, mod, cfg["r"])
        if a_shape != (r, fan_in) or b_shape != (out, r):
            problems.append(
                f"module {mod!r}: lora_A {a_shape} / lora_B {b_shape} do not fit the "
                f"base weight ({out}, {fan_in}) with rank {r}: expected A ({r}, "
                f"{fan_in}), B ({out}, {r})"
            )
        if dora and parts[MAGNITUDE].shape != (out,):
            problems.append(
                f"module {mod!r}: lora_magnitude_vector {parts[MAGNITUDE].shape} "
                f"does not fit the base weight ({out}, {fan_in}): expected ({out},) "
                "(DoRA on a linear module; on embeddings and convolutions it is not "
                "supported)"
            )
        per_leaf[k][j] = mod
    return per_leaf


def _finite(x: Any, file: str, module: str, part: str) -> np.ndarray:
    """``x`` as float32, or `FormatError` when it holds NaN or Inf.

    A non-finite adapter value makes every output of its module NaN (PEFT loads
    it so); the adapter file is corrupt, or saved from a run that diverged.
    """
    v = np.asarray(x, dtype=np.float32)
    if not np.isfinite(v).all():
        raise FormatError(
            f"{file}: {module}.{part} holds NaN or Inf; the adapter is corrupt or "
            "was saved from a run that diverged (use an earlier checkpoint)"
        )
    return v


PAD_FILE_FACTOR = 8
"""`_check_padding`: how many times its own tensors' float32 bytes a stacked
adapter's zero-padded ``A`` and ``B`` may take (beside the base weight's size)."""


def _check_padding(
    file: str,
    mods: list[str],
    n: int,
    big: int,
    fan_in: int,
    out: int,
    file_ranks: list[int],
) -> None:
    """Refuse a stacked adapter whose padding would dwarf the file and the base.

    Stacked over ``n`` layers, ``A`` and ``B`` take ``n·R·(in + out)·4`` bytes
    (``R`` the largest rank), whatever ranks the file's layers have: one layer of a
    huge rank among small ones (or alone, the other layers missing) would allocate
    about ``n`` times the file's bytes. The padded size is bounded by
    ``PAD_FILE_FACTOR`` times the file's own tensors (as float32: ``Σ r_i·(in +
    out)·4``; a legitimate ``rank_pattern`` spread or ``layers_to_transform`` on an
    eighth of the layers or more) plus the base weight's dense float32 size
    (``n·out·in·4``; any rank up to half the smaller side of the weight, on any
    layers, fits there). A larger one is not an adapter anyone trains: a rank above
    the weight's own dimensions on a few layers.

    Raises:
        FormatError: naming the file, the modules, their ranks and the bytes.
    """
    padded = n * big * (fan_in + out) * 4
    own = sum(file_ranks) * (fan_in + out) * 4
    base = n * out * fan_in * 4
    limit = PAD_FILE_FACTOR * own + base
    if padded > limit:
        shown = ", ".join(mods[:4]) + (
            f" and {len(mods) - 4} more" if len(mods) > 4 else ""
        )
        raise FormatError(
            f"{file}: {shown} (ranks {min(file_ranks)} to {big} on {len(mods)} of "
            f"{n} stacked layers, weight ({out}, {fan_in})) would take {padded:,} "
            f"bytes padded to rank {big} over the layers, above the limit of "
            f"{limit:,} ({PAD_FILE_FACTOR} x the file's {own:,} bytes of these "
            f"tensors as float32 plus the base weight's {base:,}); the adapter is "
            "corrupt or hostile (give its layers ranks within the weight's "
            "dimensions, or merge it in PEFT with merge_and_unload and load the "
            "merged model)"
        )


def _lora_leaf(
    base: Any,
    name: str,
    layers: dict[int, str],
    found: dict[str, dict[str, Any]],
    cfg: dict[str, Any],
    stacked_keys: tuple[str, ...],
    file: str,
) -> LoRAWeight:
    """The `LoRAWeight` over ``base`` from its modules' A and B (``{layer: module}``).

    Raises:
        FormatError: a tensor of ``file`` holding NaN or Inf (`_finite`), or
            padding past `_check_padding`'s bound.

    A layer of a stacked leaf without tensors gets ``A = 0``, ``B = 0``: its update
    ``s·BA`` is zero as in PEFT, and stays zero in training (both gradients,
    ``gᵀ(Ax)`` and ``Bᵀg``, are zero), so `save_adapter` leaves it out again. With
    DoRA it gets ``m = ‖W‖`` (its forward is the base's, as in PEFT), but ``m``
    trains there, where PEFT has no adapter on that layer.

    Layers with different ranks ``r_i`` (``rank_pattern`` by layer) are padded with
    zeros to the largest (within `_check_padding`'s bound), and layers with
    different ranks or alphas get their own scales
    (`entrenar.lora.weight.with_layer_ranks`).
    """
    mods = list(layers.values())
    n = logical_shape(base)[0] if stacked_split(name, stacked_keys) else 1
    fan_in = found[mods[0]]["A"].shape[1]
    out = found[mods[0]]["B"].shape[0]
    alpha_of = {
        j: _pattern(cfg.get("alpha_pattern") or {}, m, cfg["lora_alpha"])
        for j, m in layers.items()
    }
    rank_of = {j: found[m]["A"].shape[0] for j, m in layers.items()}
    first = min(layers)  # layers without tensors: the first adapted layer's r, alpha
    ranks = [rank_of.get(j, rank_of[first]) for j in range(n)]
    alphas = [alpha_of.get(j, alpha_of[first]) for j in range(n)]
    big = max(ranks)
    _check_padding(file, mods, n, big, fan_in, out, [rank_of[j] for j in layers])
    a = np.zeros((n, big, fan_in), np.float32)  # (L, R, in), zero past each r_i
    b = np.zeros((n, out, big), np.float32)  # (L, out, R)
    for j, m in layers.items():
        a[j, : rank_of[j]] = _finite(found[m]["A"], file, m, "lora_A")
        b[j, :, : rank_of[j]] = _finite(found[m]["B"], file, m, "lora_B")
    if stacked_split(name, stacked_keys) is None:
        a, b = a[0], b[0]  # (r, in), (out, r)
    node = LoRAWeight(
        base,
        jax.numpy.asarray(a),
        jax.numpy.asarray(b),
        alphas[0],
        big,
        rslora=bool(cfg.get("use_rslora", False)),
        dropout=float(cfg.get("lora_dropout", 0.0) or 0.0),
    )
    node = with_layer_ranks(node, tuple(ranks), tuple(alphas))  # plain if all agree
    if not cfg.get("use_dora", False):
        return node
    # the layers without tensors
    mag = np.array(eager_dora_norm(node), np.float32).reshape(n, out)
    for j, m in layers.items():
        mag[j] = _finite(found[m][MAGNITUDE], file, m, "lora_magnitude_vector")
    lead = tuple(node.a.shape[:-2])
    return node.replace(magnitude=jax.numpy.asarray(mag.reshape(*lead, out)))


__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "check_adapter_config",
    "load_adapter",
    "save_adapter",
]
