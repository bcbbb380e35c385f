"""The language model of a Hugging Face vision-language checkpoint.

A vision-language folder holds one ``config.json`` with a ``text_config`` and a
``vision_config``, and the weights of its language model beside those of a vision
tower and projector. With ``input_ids`` only (no ``pixel_values``) the
ConditionalGeneration forward is the text family's CausalLM forward, so entrenar reads
the language model through its family and leaves the vision part on disk (an export
copies it back byte for byte). The wrappers (`WRAPPERS`):

=============  ==================================  ===============================
model_type     models                              text_config model_type (family)
=============  ==================================  ===============================
gemma3         Gemma 3 4B/12B/27B                  gemma3_text
mistral3       Mistral Small 3.1/3.2, Ministral 3  mistral, ministral3
llava          LLaVA 1.5                           llama, mistral, qwen2
llava_next     LLaVA-NeXT (1.6)                    llama, mistral, qwen2
qwen2_vl       Qwen2-VL                            qwen2_vl_text (qwen2)
qwen2_5_vl     Qwen2.5-VL                          qwen2_5_vl_text (qwen2)
qwen3_vl       Qwen3-VL (dense)                    qwen3_vl_text (qwen3)
qwen3_vl_moe   Qwen3-VL-MoE (30B-A3B, 235B-A22B)   qwen3_vl_moe_text (qwen3_moe)
=============  ==================================  ===============================

**Qwen-VL's multimodal rotary (M-RoPE).** Qwen2-VL (Wang et al., 2024, sec. 2.1)
rotates each query and key by three position ids ``(t, h, w)``: the ``d/2``
frequencies ``θ_i`` are cut into ``mrope_section`` chunks ``[s_t, s_h, s_w]``
(chunk ``j`` turned by component ``j``; Qwen3-VL interleaves them, ``i mod 3``).
A text token has ``t = h = w = p`` (transformers' ``get_rope_index`` without an
image, or ``arange`` repeated three times), so every frequency turns by ``p θ_i``:
the ordinary rotary of Qwen2 / Qwen3 (checked against transformers' forward,
tests/io/test_hf_multimodal.py). DeepStack (Qwen3-VL) adds visual features to the
first layers' hidden states at image tokens only: nothing with text only.

Key layouts of the language model's tensors (``<m>``: the text family's name under
``model.``, ``layers.3.mlp.up_proj.weight``)::

    llava's conversion mapping (gemma3, mistral3, llava, llava_next):
      legacy (the Hub's; transformers 5's save_pretrained):
        language_model.model.<m>  language_model.lm_head.weight
        vision_tower.<v>  multi_modal_projector.<p>  (llava_next: image_newline)
      in memory (transformers >= 4.52; 4.52-4.57's save_pretrained wrote it):
        model.language_model.<m>  lm_head.weight  model.vision_tower.<v> ...
    Qwen2VLForConditionalGeneration's (qwen2_vl, qwen2_5_vl):
      legacy (the Hub's; transformers 5's save_pretrained):
        model.<m>  lm_head.weight  visual.<v>
      in memory: model.language_model.<m>  lm_head.weight  model.visual.<v>
    qwen3_vl, qwen3_vl_moe (no renaming: the Hub's files are the in-memory names):
        model.language_model.<m>  lm_head.weight  model.visual.<v>
      (Qwen3-VL-MoE's experts fused, either way round: `orient_experts`)

PEFT names modules by the in-memory layout for every wrapper
(``base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight``);
`peft_module` and `text_module` convert a module name each way.

``text_config`` keys the file leaves out take the text config class's defaults, as
transformers fills them (`Text.defaults`: those of transformers 5.25; Gemma 3 4B's
``text_config`` names six keys, LLaVA 1.5's five). Qwen2-VL and Qwen2.5-VL files
may have no ``text_config``: their text keys sit at the top level (`Wrapper.flat_keys`,
the text config's fields, as transformers moves them). The model ties its head to the
embeddings when the checkpoint has no ``lm_head`` (transformers 5 ties by the
top-level ``tie_word_embeddings``, `Wrapper.tie_default` when absent, unless both
tensors are stored).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from entrenar.errors import FormatError, UnsupportedError
from entrenar.nn.multimodal_defaults import (
    GEMMA3_TEXT,
    LLAMA_TEXT,
    MINISTRAL3_TEXT,
    MISTRAL_SMALL,
    MISTRAL_TEXT,
    QWEN2_TEXT,
    QWEN2_VL_FLAT,
    QWEN2_VL_TEXT,
    QWEN3_VL_MOE_TEXT,
    QWEN3_VL_TEXT,
)

LEGACY, IN_MEMORY = "legacy", "in-memory"
"""The two key layouts (module docstring)."""


@dataclasses.dataclass(frozen=True)
class Text:
    """A ``text_config`` ``model_type`` of a wrapper, and how entrenar reads it.

    Attributes:
        family: the ``model_type`` of the entrenar family that reads it
            (``"qwen2"`` for ``qwen2_vl_text``).
        defaults: transformers' defaults of its config class, for the keys the
            family reads.
        theta: the config class's rotary base where the file names none (None:
            the family's own default).
        mrope: ``"chunked"`` (Qwen2-VL: ``mrope_section`` chunks, which must sum
            to ``d/2``) or ``"interleaved"`` (Qwen3-VL): multimodal rotary, read
            as the plain rotary it is on text (module docstring); None: none.
        drop: keys transformers' text class does not read, which the family would.
        fixed: keys set whatever the file says (Qwen3-VL-MoE's router always
            renormalises: ``norm_topk_prob`` true).
        aliases: ``{file key: the key the family reads}`` (``num_local_experts``,
            what transformers 5.25 writes for ``num_experts``).
    """

    family: str
    defaults: Mapping[str, Any]
    theta: float | None = None
    mrope: str | None = None
    drop: tuple[str, ...] = ()
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """A vision-language ``model_type`` whose language model entrenar reads.

    Attributes:
        model_type: the folder's ``config.json`` ``model_type``.
        hf_class: its ``architectures`` entry.
        texts: ``{text_config model_type: Text}`` it may hold.
        default_text: the ``text_config`` ``model_type`` when it names none.
        absent: the ``text_config`` transformers builds when the file has none;
            None: the text keys are the top level's `flat_keys` (Qwen2-VL).
        names: ``(stored prefix, layout, text prefix)`` of the language model's
            tensor names, first match wins; layout None: the same in both.
        vision: the top modules that are not the language model.
        tie_default: the top-level ``tie_word_embeddings`` when absent.
        flat_keys: the text config's fields, read from the top level when the
            file has no ``text_config`` (``absent`` None).
        fused_experts: the experts are stored fused, ``mlp.experts.gate_up_proj``
            and ``down_proj``, either way round (`orient_experts`, `fuse_experts`).
    """

    model_type: str
    hf_class: str
    texts: Mapping[str, Text]
    default_text: str
    absent: Mapping[str, Any] | None
    names: tuple[tuple[str, str | None, str], ...]
    vision: tuple[str, ...]
    tie_default: bool
    flat_keys: tuple[str, ...] = ()
    fused_experts: bool = False


_LLAVA_NAMES: tuple[tuple[str, str | None, str], ...] = (
    ("language_model.model.", LEGACY, "model."),
    ("language_model.lm_head.", LEGACY, "lm_head."),
    ("model.language_model.", IN_MEMORY, "model."),
    ("lm_head.", IN_MEMORY, "lm_head."),
)
_QWEN2_VL_NAMES: tuple[tuple[str, str | None, str], ...] = (
    ("model.language_model.", IN_MEMORY, "model."),
    ("model.", LEGACY, "model."),
    ("lm_head.", None, "lm_head."),
)
_QWEN3_VL_NAMES = (_QWEN2_VL_NAMES[0], _QWEN2_VL_NAMES[2])
_LLAVA_VISION = ("vision_tower", "multi_modal_projector")
_LLAVA_TEXTS = {
    "llama": Text("llama", LLAMA_TEXT),
    "mistral": Text("mistral", MISTRAL_TEXT),
    "qwen2": Text("qwen2", QWEN2_TEXT),
}


def _qwen_vl(model_type: str, hf_class: str, text: str, *, tie: bool) -> Wrapper:
    """Qwen2-VL and Qwen2.5-VL (text_config ``<model_type>_text``, read as qwen2)."""
    defaults = {"model_type": text, **QWEN2_VL_TEXT}
    qwen2 = Text("qwen2", defaults, 1e6, "chunked", ("head_dim",))
    return Wrapper(
        model_type, hf_class, {text: qwen2}, text, None, _QWEN2_VL_NAMES,
        ("visual",), tie, QWEN2_VL_FLAT,
    )  # fmt: skip


WRAPPERS: dict[str, Wrapper] = {
    "gemma3": Wrapper(
        "gemma3", "Gemma3ForConditionalGeneration",
        {"gemma3_text": Text("gemma3_text", GEMMA3_TEXT)}, "gemma3_text", {},
        _LLAVA_NAMES, _LLAVA_VISION, True,
    ),
    "mistral3": Wrapper(
        "mistral3", "Mistral3ForConditionalGeneration",
        {"mistral": Text("mistral", MISTRAL_TEXT),
         "ministral3": Text("ministral3", MINISTRAL3_TEXT)},
        "mistral", MISTRAL_SMALL, _LLAVA_NAMES, _LLAVA_VISION, True,
    ),
    "llava": Wrapper(
        "llava", "LlavaForConditionalGeneration", _LLAVA_TEXTS, "llama", {},
        _LLAVA_NAMES, _LLAVA_VISION, False,
    ),
    "llava_next": Wrapper(
        "llava_next", "LlavaNextForConditionalGeneration", _LLAVA_TEXTS, "llama", {},
        _LLAVA_NAMES, (*_LLAVA_VISION, "image_newline"), False,
    ),
    "qwen2_vl": _qwen_vl(
        "qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2_vl_text", tie=False
    ),
    "qwen2_5_vl": _qwen_vl(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text",
        tie=False,
    ),
    "qwen3_vl": Wrapper(
        "qwen3_vl", "Qwen3VLForConditionalGeneration",
        {"qwen3_vl_text": Text(
            "qwen3", QWEN3_VL_TEXT, 5e5, "interleaved",
            ("use_sliding_window", "sliding_window", "layer_types",
             "max_window_layers"),
        )},
        "qwen3_vl_text", {}, _QWEN3_VL_NAMES, ("visual",), False,
    ),
    "qwen3_vl_moe": Wrapper(
        "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration",
        {"qwen3_vl_moe_text": Text(
            "qwen3_moe", QWEN3_VL_MOE_TEXT, 5e5, "interleaved",
            ("use_sliding_window", "sliding_window", "layer_types",
             "max_window_layers", "norm_topk_prob"),
            {"norm_topk_prob": True}, {"num_local_experts": "num_experts"},
        )},
        "qwen3_vl_moe_text", {}, _QWEN3_VL_NAMES, ("visual",), False,
        fused_experts=True,
    ),
}  # fmt: skip
"""The vision-language model types whose language model entrenar reads."""


def wrapper(model_type: Any) -> Wrapper | None:
    """The `Wrapper` of a ``config.json`` ``model_type``, or None."""
    return WRAPPERS.get(model_type) if isinstance(model_type, str) else None


def text_config(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A wrapper's ``text_config`` as its text family's ``config.json`` dict.

    transformers' defaults fill the keys the file leaves out; the ``model_type``
    is the family's; a multimodal rotary is the plain one (module docstring).

    Raises:
        FormatError: ``text_config`` is not an object, names a text
            ``model_type`` the wrapper does not hold, or an ``mrope_section``
            transformers cannot apply.
        UnsupportedError: a ``quantization_config`` (FP8, AWQ, GPTQ, ... files).
    """
    w = WRAPPERS[str(hf["model_type"])]
    quant = hf.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise UnsupportedError(
            f"{source}: quantization_config (quant_method {method!r}) is not "
            f"supported for a {w.model_type} folder: entrenar reads float weights; "
            "use the checkpoint's bfloat16 release (Ministral 3: the -BF16 or -Base "
            "folders)"
        )
    given = hf.get("text_config", None)
    if given is None:
        flat = {k: hf[k] for k in w.flat_keys if k in hf}
        given = flat if w.absent is None else dict(w.absent)
    if not isinstance(given, Mapping):
        raise FormatError(
            f"{source}: text_config = {str(given)[:40]!r} is not an object"
        )
    kind = given.get("model_type", w.default_text)
    text = w.texts.get(kind) if isinstance(kind, str) else None
    if text is None:
        raise FormatError(
            f"{source}: a {w.model_type} text_config of model_type {kind!r}; "
            f"entrenar reads {list(w.texts)} there"
        )
    given = {text.aliases.get(k, k): v for k, v in given.items()}
    out = {**text.defaults, **given, "model_type": text.family}
    for key in text.drop:
        out.pop(key, None)
    out.update(text.fixed)
    if text.theta is not None:  # transformers: the rope dict's, the top's, default
        rope = out.get("rope_parameters") or out.get("rope_scaling")
        theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
        out["rope_theta"] = out.get("rope_theta", text.theta) if theta is None else (
            theta
        )  # fmt: skip
    if text.mrope is not None:
        _plain_rope(out, text.mrope, source)
    return out


def _plain_rope(text: dict[str, Any], mrope: str, source: str) -> None:
    """Qwen-VL's rotary dicts (``type: mrope``) as the ``default`` rotary, in place.

    Raises:
        FormatError: a chunked ``mrope_section`` that does not sum to ``d/2``
            (transformers' ``split`` fails on it).
    """
    section: Any = [16, 24, 24] if mrope == "chunked" else None  # transformers'
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if not isinstance(rope, Mapping):
            continue
        rope = dict(rope)
        if "mrope" in (rope.get("rope_type"), rope.get("type")):
            rope.pop("type", None)
            rope["rope_type"] = "default"
        section = rope.pop("mrope_section", section)
        rope.pop("mrope_interleaved", None)
        text[key] = rope
    if mrope != "chunked":
        return
    half = int(text["hidden_size"]) // int(text["num_attention_heads"]) // 2
    if (
        not isinstance(section, (list, tuple))
        or not all(isinstance(s, int) and s >= 0 for s in section)
        or sum(section) != half
    ):
        raise FormatError(
            f"{source}: text_config rope mrope_section = {str(section)[:40]!r} "
            f"must be counts that sum to head_dim / 2 = {half} (the rotary "
            "frequencies each of t, h, w turns)"
        )


def _layout_of(name: str, w: Wrapper) -> tuple[str | None, str] | None:
    """``(layout, text name)`` of a language-model tensor name, else None."""
    for prefix, layout, into in w.names:
        if name.startswith(prefix):
            return layout, into + name[len(prefix) :]
    return None


def is_vision(name: str, kind: str) -> bool:
    """Whether a tensor or module name is of wrapper ``kind``'s vision part."""
    name = name.removeprefix("model.")
    parts = WRAPPERS[kind].vision
    return any(name == p or name.startswith(p + ".") for p in parts)


@dataclasses.dataclass(frozen=True)
class Split:
    """A wrapper checkpoint's tensors, split into the language model and the rest.

    Attributes:
        text: ``{text family name: stored name}`` (``model.layers.0...`` ->
            ``language_model.model.layers.0...``).
        layout: `LEGACY` or `IN_MEMORY` (the language model's names).
        skipped: the vision part's names, in the file's form.
        skipped_params: how many parameters they hold.
        kind: the wrapper's ``model_type``.
    """

    text: dict[str, str]
    layout: str
    skipped: tuple[str, ...]
    skipped_params: int
    kind: str


def split_tensors(flat: Mapping[str, Any], source: str, kind: str) -> Split:
    """The language model's tensor names as the text family's, and the rest.

    ``flat`` maps the stored names to anything with a ``shape`` (memory-mapped
    arrays); ``kind``: the wrapper's ``model_type``.

    Raises:
        FormatError: a name that is neither (naming it), the two layouts mixed, or
            no language-model tensor.
    """
    w = WRAPPERS[kind]
    text: dict[str, str] = {}
    layouts: set[str] = set()
    skipped: list[str] = []
    for name in flat:
        found = None if is_vision(name, kind) else _layout_of(name, w)
        if found is None:
            if not is_vision(name, kind):
                ours = ", ".join(p + "*" for p, _, _ in w.names)
                raise FormatError(
                    f"{source}: tensor {name!r} is neither of the {kind} language "
                    f"model ({ours}) nor of {' / '.join(w.vision)}"
                )
            skipped.append(name)
            continue
        if found[0] is not None:
            layouts.add(found[0])
        text[found[1]] = name
    if not text:
        raise FormatError(f"{source}: no language-model tensor ({w.names[0][0]}*, ...)")
    if len(layouts) > 1:
        by = {lay: p for p, lay, into in w.names if into == "model."}
        raise FormatError(
            f"{source}: mixes the legacy ({by[LEGACY]}*) and the in-memory "
            f"({by[IN_MEMORY]}*) key layouts"
        )
    params = sum(math.prod(flat[n].shape) for n in skipped)
    layout = layouts.pop() if layouts else IN_MEMORY
    return Split(text, layout, tuple(sorted(skipped)), params, kind)


def wrapped_name(name: str, layout: str, kind: str) -> str:
    """A text family tensor name (``model.norm.weight``) in ``layout``'s form."""
    dotted = name + "."  # a module name (``lm_head``) as well as a tensor's
    for prefix, lay, into in WRAPPERS[kind].names:
        if lay in (layout, None) and dotted.startswith(into):
            return (prefix + dotted[len(into) :])[:-1]
    raise ValueError(f"{name!r} has no {layout} {kind} name")


def peft_module(module: str) -> str:
    """A text module name as PEFT names it on the ConditionalGeneration model.

    Every wrapper's in-memory layout (module docstring):

    >>> peft_module("model.layers.0.self_attn.q_proj")
    'model.language_model.layers.0.self_attn.q_proj'
    >>> peft_module("lm_head")
    'lm_head'
    """
    return wrapped_name(module, IN_MEMORY, "llava")


def text_module(module: str, kind: str) -> str | None:
    """A PEFT module name of either layout as the text module's, else None.

    >>> text_module("language_model.model.layers.0.mlp.up_proj", "gemma3")
    'model.layers.0.mlp.up_proj'
    >>> text_module("model.visual.blocks.0.attn.qkv", "qwen2_vl") is None
    True
    """
    if is_vision(module, kind):
        return None
    found = _layout_of(module + ".", WRAPPERS[kind])
    return None if found is None else found[1][:-1]


_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_STACKED = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(gate|up|down)_proj\.weight$"
)


def _fused_shapes(config: Any) -> dict[str, tuple[int, int, int]]:
    """One layer's fused experts' shapes in transformers' memory."""
    e, i, d = config.num_experts, config.expert_size, config.hidden_size
    return {"gate_up_proj": (e, 2 * i, d), "down_proj": (e, d, i)}


def orient_experts(flat: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """Qwen3-VL-MoE's fused experts in transformers' in-memory orientation.

    The Hub's files store ``gate_up_proj (E, D, 2I)`` and ``down_proj (E, I, D)``
    (its first implementation's ``bmm`` layout), transformers 5.25's
    ``save_pretrained`` ``(E, 2I, D)`` and ``(E, D, I)``; as transformers'
    ``Transpose(1, 2, check_dims=True)`` does, a tensor of the in-memory shape is
    kept and any other is transposed (a lazy view of the memory-mapped file).
    """
    want = _fused_shapes(config)
    out = dict(flat)
    for name, value in flat.items():
        m = _FUSED.match(name)
        if m is not None and tuple(value.shape) != want[m.group(2)]:
            out[name] = np.swapaxes(value, 1, 2)
    return out


def fuse_experts(
    made: Mapping[str, Callable[[], Any]],
    config: Any,
    stored: Mapping[str, tuple[int, ...]],
    dense: Callable[[Any], Any],
) -> dict[str, Callable[[], Any]]:
    """The tree's stacked experts as Qwen3-VL-MoE's fused tensors, lazily.

    ``made``: ``{tree name: make}`` (``model.layers.0.mlp.experts.gate_proj.weight
    (E, I, D)``); ``stored``: the source's shapes by text name, so each fused
    tensor is written the way round the source stored it (`orient_experts`);
    ``dense``: a weight node -> its array.
    """
    want = _fused_shapes(config)
    out: dict[str, Callable[[], Any]] = {}
    parts: dict[tuple[int, str], Callable[[], Any]] = {}
    for name, make in made.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = make
        else:
            parts[(int(m.group(1)), m.group(2))] = make
    for layer in sorted({i for i, _ in parts}):
        fused = {  # (E, 2I, D), (E, D, I)
            "gate_up_proj": [parts[(layer, "gate")], parts[(layer, "up")]],
            "down_proj": [parts[(layer, "down")]],
        }
        for proj, makes in fused.items():
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            flip = tuple(stored.get(name, want[proj])) != want[proj]
            out[name] = functools.partial(_joined, makes, dense, flip)
    return out


def _joined(
    makes: list[Callable[[], Any]], dense: Callable[[Any], Any], flip: bool
) -> Any:
    """``makes``' arrays joined on axis 1, axes 1 and 2 swapped if ``flip``.

    In jax.numpy, so a writer can trace it for its shape (`jax.eval_shape`).
    """
    joined = jnp.concatenate([jnp.asarray(dense(make())) for make in makes], axis=1)
    return jnp.swapaxes(joined, 1, 2) if flip else joined


def ties_head(hf: Mapping[str, Any]) -> bool:
    """Whether transformers ties a wrapper's head (when the weights hold none).

    The top-level ``tie_word_embeddings`` (`Wrapper.tie_default` when absent),
    or the ``text_config``'s (LLaVA's and Qwen2-VL's configs raise the top's).
    """
    w = WRAPPERS[str(hf["model_type"])]
    text = hf.get("text_config")
    text_ties = isinstance(text, Mapping) and text.get("tie_word_embeddings") is True
    return bool(hf.get("tie_word_embeddings", w.tie_default)) or text_ties


__all__ = [
    "IN_MEMORY",
    "LEGACY",
    "WRAPPERS",
    "Split",
    "Text",
    "Wrapper",
    "fuse_experts",
    "is_vision",
    "orient_experts",
    "peft_module",
    "split_tensors",
    "text_config",
    "text_module",
    "ties_head",
    "wrapped_name",
    "wrapper",
]
