"""The language model of a Hugging Face vision-language checkpoint (Gemma 3, Mistral 3).

Gemma 3 4B/12B/27B (``model_type: gemma3``, ``Gemma3ForConditionalGeneration``) and
Mistral Small 3.1/3.2 (``mistral3``, ``Mistral3ForConditionalGeneration``) ship as
one folder: a ``text_config`` (``gemma3_text`` / ``mistral``), a ``vision_config``,
and the weights of the language model beside ``vision_tower.*`` and
``multi_modal_projector.*``. With ``input_ids`` only, the ConditionalGeneration
forward is the text family's CausalLM forward, so entrenar reads the language model
through its family (`entrenar.nn.gemma`, `entrenar.nn.mistral`) and leaves the
vision tower and projector on disk (an export copies them back byte for byte).

Two key layouts name the language model's tensors (transformers' ``llava``
conversion mapping, which both classes use)::

    legacy (the Hub's files; transformers 4.x and 5.x save_pretrained):
        language_model.model.<m>      language_model.lm_head.weight
        vision_tower.<v>              multi_modal_projector.<p>
    in memory (transformers >= 4.52; 4.52-4.57's save_pretrained wrote it):
        model.language_model.<m>      lm_head.weight
        model.vision_tower.<v>        model.multi_modal_projector.<p>

where ``<m>`` is the text family's name under ``model.`` (``layers.3.mlp.up_proj.
weight``). PEFT names modules by the in-memory layout
(``base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight``);
`peft_module` and `text_module` convert a module name each way.

``text_config`` keys the file leaves out take the text config class's defaults, as
transformers fills them (`TEXT_DEFAULTS`: Gemma3TextConfig's and MistralConfig's of
transformers 5.25; Gemma 3 4B's ``text_config`` names six keys). The model ties its
head to the embeddings when the checkpoint has no ``lm_head`` (transformers 5 ties by
the top-level ``tie_word_embeddings``, default true, unless both tensors are stored).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from entrenar.errors import FormatError

LEGACY, IN_MEMORY = "legacy", "in-memory"
"""The two key layouts (module docstring)."""


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """A vision-language ``model_type`` whose language model entrenar reads.

    Attributes:
        model_type: the folder's ``config.json`` ``model_type``.
        hf_class: its ``architectures`` entry.
        text_model_types: the ``text_config`` ``model_type`` values it may hold.
        text_defaults: transformers' defaults of the text config class, for the
            keys the text families read.
        absent: the ``text_config`` transformers builds when the file has none.
    """

    model_type: str
    hf_class: str
    text_model_types: tuple[str, ...]
    text_defaults: Mapping[str, Any]
    absent: Mapping[str, Any] = dataclasses.field(default_factory=dict)


_GEMMA3_TEXT: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "initializer_range": 0.02,
}
_MISTRAL_TEXT: dict[str, Any] = {
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "sliding_window": 4096,
    "initializer_range": 0.02,
}
_MISTRAL_SMALL: dict[str, Any] = {  # Mistral3Config's text_config when none is given
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000000.0,
    "sliding_window": None,
    "vocab_size": 131072,
}

WRAPPERS: dict[str, Wrapper] = {
    "gemma3": Wrapper(
        "gemma3", "Gemma3ForConditionalGeneration", ("gemma3_text",), _GEMMA3_TEXT
    ),
    "mistral3": Wrapper(
        "mistral3",
        "Mistral3ForConditionalGeneration",
        ("mistral",),
        _MISTRAL_TEXT,
        _MISTRAL_SMALL,
    ),
}
"""The vision-language model types whose language model entrenar reads."""

VISION_PARTS = ("vision_tower", "multi_modal_projector")
"""The top modules of a wrapper that are not the language model."""


def wrapper(model_type: Any) -> Wrapper | None:
    """The `Wrapper` of a ``config.json`` ``model_type``, or None."""
    return WRAPPERS.get(model_type) if isinstance(model_type, str) else None


def text_config(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A wrapper's ``text_config`` with transformers' defaults filled in.

    Raises:
        FormatError: ``text_config`` is not an object, or names a text
            ``model_type`` the wrapper does not hold.
    """
    w = WRAPPERS[str(hf["model_type"])]
    given = hf.get("text_config", None)
    if given is None:
        given = dict(w.absent)
    if not isinstance(given, Mapping):
        raise FormatError(
            f"{source}: text_config = {str(given)[:40]!r} is not an object"
        )
    text = {**w.text_defaults, **given}
    if text["model_type"] not in w.text_model_types:
        raise FormatError(
            f"{source}: a {w.model_type} text_config of model_type "
            f"{text['model_type']!r}; entrenar reads {list(w.text_model_types)} there"
        )
    return text


def _layout_of(name: str) -> tuple[str, str] | None:
    """``(layout, text name)`` of a language-model tensor name, else None."""
    for prefix, layout, into in (
        ("language_model.model.", LEGACY, "model."),
        ("language_model.lm_head.", LEGACY, "lm_head."),
        ("model.language_model.", IN_MEMORY, "model."),
    ):
        if name.startswith(prefix):
            return layout, into + name[len(prefix) :]
    if name.startswith("lm_head."):
        return IN_MEMORY, name
    return None


def is_vision(name: str) -> bool:
    """Whether a tensor or module name is of the vision tower or projector."""
    name = name.removeprefix("model.")
    return any(name == p or name.startswith(p + ".") for p in VISION_PARTS)


@dataclasses.dataclass(frozen=True)
class Split:
    """A wrapper checkpoint's tensors, split into the language model and the rest.

    Attributes:
        text: ``{text family name: stored name}`` (``model.layers.0...`` ->
            ``language_model.model.layers.0...``).
        layout: `LEGACY` or `IN_MEMORY` (the language model's names).
        skipped: the vision tower's and projector's names, in the file's form.
        skipped_params: how many parameters they hold.
    """

    text: dict[str, str]
    layout: str
    skipped: tuple[str, ...]
    skipped_params: int


def split_tensors(flat: Mapping[str, Any], source: str) -> Split:
    """The language model's tensor names as the text family's, and the rest.

    ``flat`` maps the stored names to anything with a ``shape`` (memory-mapped
    arrays).

    Raises:
        FormatError: a name that is neither (naming it), the two layouts mixed, or
            no language-model tensor.
    """
    text: dict[str, str] = {}
    layouts: set[str] = set()
    skipped: list[str] = []
    for name in flat:
        found = _layout_of(name)
        if found is None:
            if not is_vision(name):
                raise FormatError(
                    f"{source}: tensor {name!r} is neither of the language model "
                    f"(language_model.*, model.language_model.*, lm_head) nor of "
                    f"{' / '.join(VISION_PARTS)}"
                )
            skipped.append(name)
            continue
        layouts.add(found[0])
        text[found[1]] = name
    if not text:
        raise FormatError(f"{source}: no language-model tensor (language_model.*)")
    if len(layouts) > 1:
        raise FormatError(
            f"{source}: mixes the legacy (language_model.model.*) and the "
            "in-memory (model.language_model.*) key layouts"
        )
    params = sum(math.prod(flat[n].shape) for n in skipped)
    return Split(text, layouts.pop(), tuple(sorted(skipped)), params)


def wrapped_name(name: str, layout: str) -> str:
    """A text family tensor name (``model.norm.weight``) in ``layout``'s form."""
    if name.startswith("model."):
        rest = name[len("model.") :]
        if layout == LEGACY:
            return "language_model.model." + rest
        return "model.language_model." + rest
    if layout == LEGACY:
        return "language_model." + name
    return name


def peft_module(module: str) -> str:
    """A text module name as PEFT names it on the ConditionalGeneration model.

    >>> peft_module("model.layers.0.self_attn.q_proj")
    'model.language_model.layers.0.self_attn.q_proj'
    >>> peft_module("lm_head")
    'lm_head'
    """
    return wrapped_name(module, IN_MEMORY)


def text_module(module: str) -> str | None:
    """A PEFT module name of either layout as the text module's, else None.

    >>> text_module("language_model.model.layers.0.mlp.up_proj")
    'model.layers.0.mlp.up_proj'
    >>> text_module("model.vision_tower.encoder.layers.0.self_attn.q_proj") is None
    True
    """
    found = _layout_of(module + ".")
    return None if found is None else found[1][:-1]


__all__ = [
    "IN_MEMORY",
    "LEGACY",
    "VISION_PARTS",
    "WRAPPERS",
    "Split",
    "Wrapper",
    "is_vision",
    "peft_module",
    "split_tensors",
    "text_config",
    "text_module",
    "wrapped_name",
    "wrapper",
]
