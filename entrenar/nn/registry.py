"""The architecture registry: the one place the library asks what a model family is.

Every architecture (``llama``, ``mistral``, ``qwen2``, ``gpt2``, ``mlp``, ...) is an
`Architecture` record registered by its module under `entrenar.nn` with
`register_architecture`. The rest of the library never names a family: the YAML
``model.architecture`` choice, Hugging Face ``config.json`` files (by ``model_type``),
llama.cpp GGUF files (by ``general.architecture``), `entrenar info` and the
conformance tests all look the family up here::

    arch = architecture_for_hf(json.load(open("config.json")), "config.json")
    config = arch.from_hf(hf_dict)          # a config that is also the model
    logits = config.apply(params, tokens)

Adding a family is one new module that builds its config and calls
`register_architecture` once (specs/models.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from entrenar.errors import FormatError, UnsupportedError


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One registered model family.

    Attributes:
        name: the registry key and the YAML ``model.architecture`` value.
        config_class: the frozen config dataclass that is also the model
            (``init(key)``, ``apply(params, inputs)``).
        summary: one line for `entrenar info` and the docs.
        hf_model_types: Hugging Face ``config.json`` ``model_type`` values it reads.
        hf_class: the ``architectures`` entry a Hugging Face folder written for it
            carries (``"LlamaForCausalLM"``).
        gguf_name: llama.cpp's ``general.architecture`` for it (None: no GGUF form).
        from_hf: ``config.json`` dict -> config (None: no Hugging Face form).
        to_hf: config -> ``config.json`` dict.
        defaults: fields of ``config_class`` the family sets before the user's
            (``{"architecture": "qwen2", "attention_bias": True}``): `make_config`
            builds a from-scratch model of the family with them.
        tiny: a tiny config with every feature of the family switched on, for the
            conformance tests (None only for non-language models).
        from_hf_tensors: ``(flat, config) -> flat``: a checkpoint's tensors by
            name (memory-mapped arrays) -> the names and shapes of the family's
            tree (`entrenar.nn.from_hf_names`); None: the names are the tree's.
        to_hf_tensors: ``(made, config) -> made``: the other way, on
            ``{name: make}`` (each ``make()`` an array or weight node), lazily.
    """

    name: str
    config_class: type
    summary: str
    hf_model_types: tuple[str, ...] = ()
    hf_class: str | None = None
    gguf_name: str | None = None
    from_hf: Callable[[Mapping[str, Any]], Any] | None = None
    to_hf: Callable[[Any], dict[str, Any]] | None = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tiny: Callable[[], Any] | None = None
    from_hf_tensors: Callable[[Mapping[str, Any], Any], dict[str, Any]] | None = None
    to_hf_tensors: (
        Callable[[Mapping[str, Callable[[], Any]], Any], dict[str, Any]] | None
    ) = None

    def make_config(self, **fields: Any) -> Any:
        """``config_class(**defaults, **fields)``: a model of this family."""
        return self.config_class(**{**self.defaults, **fields})


_REGISTRY: dict[str, Architecture] = {}

_MOE = " (a mixture of experts entrenar does not implement: {})"
NOT_IMPLEMENTED = {
    "llama4": _MOE.format("Llama 4's interleaved MoE and chunked attention"),
    "jamba": _MOE.format("Mamba layers"),
    "dbrx": _MOE.format("DBRX's fused layout and clipped qkv"),
    "phimoe": _MOE.format("sparsemixer routing"),
    "cohere2_moe": _MOE.format(
        "Cohere 2 MoE's dense prefix layers and averaged shared experts"
    ),
    "ernie4_5_moe": _MOE.format("ERNIE 4.5's MoE; the dense ernie4_5 is read"),
}
_VLM = (
    " (a vision-language model whose language model entrenar does not read: {}; "
    "entrenar reads the language model of gemma3, mistral3, llava, llava_next, "
    "qwen2_vl, qwen2_5_vl, qwen3_vl and qwen3_vl_moe folders)"
)
NOT_IMPLEMENTED |= {
    "mllama": _VLM.format("Llama 3.2 Vision's cross-attention layers"),
    "gemma3n": _VLM.format("Gemma 3n's per-layer embeddings and AltUp"),
    "paligemma": _VLM.format("prefix-LM attention over the image and prompt"),
}
"""Hugging Face ``model_type`` values refused with a reason (the MoE families
entrenar reads are ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``gpt_oss``,
``deepseek_v2``, ``deepseek_v3``, ``olmoe``, ``granitemoe`` and ``granitemoeshared``;
the vision-language ones ``gemma3``, ``mistral3``, ``llava``, ``llava_next``,
``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` and ``qwen3_vl_moe``, by their language
model)."""
GGUF_MOE = frozenset({"deepseek", "llama4", "dbrx", "phimoe", "jamba", "cohere2moe"})
"""llama.cpp ``general.architecture`` names of mixtures of experts entrenar does not
read (it reads ``llama`` with experts as Mixtral, ``qwen2moe``, ``qwen3moe``,
``gpt-oss``, ``olmoe``, ``granitemoe`` (Granite MoE shared included), ``deepseek2``
and ``glm4moe``)."""


def register_architecture(arch: Architecture) -> Architecture:
    """Add ``arch`` to the registry (its name, model types and GGUF name unique)."""
    if arch.name in _REGISTRY:
        raise ValueError(f"architecture {arch.name!r} is already registered")
    for other in _REGISTRY.values():
        shared = set(arch.hf_model_types) & set(other.hf_model_types)
        if shared:
            raise ValueError(
                f"model_type {sorted(shared)} already read by {other.name}"
            )
        if arch.gguf_name and arch.gguf_name == other.gguf_name:
            raise ValueError(
                f"GGUF name {arch.gguf_name!r} already read by {other.name}"
            )
    _REGISTRY[arch.name] = arch
    return arch


def architectures() -> tuple[Architecture, ...]:
    """Every registered architecture, in registration order."""
    return tuple(_REGISTRY.values())


def architecture_names() -> tuple[str, ...]:
    """The names `architecture` accepts (the YAML ``model.architecture`` choices)."""
    return tuple(_REGISTRY)


def architecture(name: str) -> Architecture:
    """The architecture registered as ``name``.

    Raises:
        UnsupportedError: no such architecture (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnsupportedError(
            f"unknown architecture {name!r}; entrenar knows {sorted(_REGISTRY)}"
        ) from None


def architecture_of(config: Any) -> Architecture:
    """A model config's architecture: its ``architecture`` field, else its class."""
    name = getattr(config, "architecture", None)
    if isinstance(name, str):
        return architecture(name)
    for arch in _REGISTRY.values():
        if type(config) is arch.config_class:
            return arch
    raise UnsupportedError(f"{type(config).__name__} is not a registered architecture")


def architecture_for_hf(hf: Mapping[str, Any], source: str) -> Architecture:
    """The architecture that reads a Hugging Face ``config.json`` dict.

    Raises:
        FormatError: no ``model_type`` in ``source``.
        UnsupportedError: a ``model_type`` no registered architecture reads.
    """
    model_type = hf.get("model_type")
    if not isinstance(model_type, str):
        raise FormatError(f"{source}: no 'model_type' string; is it a model config?")
    for arch in _REGISTRY.values():
        if model_type in arch.hf_model_types and arch.from_hf is not None:
            return arch
    known = sorted(t for a in _REGISTRY.values() for t in a.hf_model_types)
    hint = NOT_IMPLEMENTED.get(model_type, "")
    raise UnsupportedError(
        f"{source}: model_type {model_type!r} is not supported{hint}; entrenar "
        f"reads {known}"
    )


def architecture_for_gguf(name: str, source: str) -> Architecture:
    """The architecture of a GGUF file whose ``general.architecture`` is ``name``.

    Raises:
        UnsupportedError: no registered architecture has that GGUF name.
    """
    for arch in _REGISTRY.values():
        if arch.gguf_name == name:
            return arch
    known = sorted(a.gguf_name for a in _REGISTRY.values() if a.gguf_name)
    hint = ""
    if name in GGUF_MOE:
        hint = (
            " (a mixture of experts entrenar does not implement; it reads Mixtral "
            "(llama with expert_count), qwen2moe, qwen3moe, gpt-oss, olmoe, "
            "granitemoe, deepseek2 and glm4moe from GGUF)"
        )
    raise UnsupportedError(
        f"{source}: general.architecture {name!r} is not supported{hint}; entrenar "
        f"reads {known}"
    )


__all__ = [
    "Architecture",
    "architecture",
    "architecture_for_gguf",
    "architecture_for_hf",
    "architecture_names",
    "architecture_of",
    "architectures",
    "register_architecture",
]
