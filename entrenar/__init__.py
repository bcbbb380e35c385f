"""entrenar: training and fine-tuning neural networks on JAX.

Layers, each importing only the ones below it (specs/conventions.md; a test checks)::

    cli            the `entrenar` command (not imported here: ``python -m entrenar``)
    runs           workflows: train_from_yaml, evaluate, generate, merge, quantize
    config         the YAML schema: YAML -> frozen dataclasses, checked
    train  chat    Trainer, jitted steps, checkpoints; chat inference
    data  merge    loaders, tokenizers, packing; TIES/DARE/SLERP model merging
    distributed    meshes, FSDP / data-parallel sharding rules, multi-host start-up
    preference     DPO and TRL's loss types; the reference with LoRA adapters off
    lora  distill  LoRA/QLoRA pytree transforms; distillation losses
    io             JSON, YAML, safetensors, GGUF, tokenizer, SmolLM2
    autograd quant Tensor API over nn's math; QuantizedWeight formats
    nn  optim      models, layers, losses; (init, update) optimizers, schedules
    tree  gradients, errors, types

Params are pytrees, transforms never mutate, randomness is an explicit ``key``.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and docs
    from entrenar import (
        autograd,
        config,
        data,
        distill,
        distributed,
        errors,
        io,
        lora,
        merge,
        nn,
        optim,
        preference,
        quant,
        runs,
        train,
    )
    from entrenar.autograd import Tensor, check_gradient, no_grad
    from entrenar.autograd.backward import backward
    from entrenar.gradients import grad, value_and_grad
    from entrenar.tree import (
        assert_trees_allclose,
        tree_bytes,
        tree_named_leaves,
        tree_size,
    )
    from entrenar.types import (
        Array,
        Grads,
        OptState,
        Params,
        PRNGKey,
        PyTree,
        Updates,
    )

_SUBMODULES = frozenset(
    "autograd config data distill distributed errors io lora merge nn optim "
    "preference quant runs train".split()
)
_HOMES = {
    **dict.fromkeys(["Tensor", "backward", "check_gradient", "no_grad"], "autograd"),
    **dict.fromkeys(["grad", "value_and_grad"], "gradients"),
    **dict.fromkeys(
        ["assert_trees_allclose", "tree_bytes", "tree_named_leaves", "tree_size"],
        "tree",
    ),
    **dict.fromkeys(
        ["Array", "Grads", "OptState", "Params", "PRNGKey", "PyTree", "Updates"],
        "types",
    ),
}


def __getattr__(name: str) -> Any:
    """Import a subpackage or a top-level name when first used (PEP 562).

    ``import entrenar`` loads no JAX, so ``entrenar --help`` starts at once; the
    first ``entrenar.nn`` (or ``from entrenar import Tensor``) imports what it needs.
    """
    if name in _SUBMODULES:
        return importlib.import_module(f"entrenar.{name}")
    if name in _HOMES:
        value = getattr(importlib.import_module(f"entrenar.{_HOMES[name]}"), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'entrenar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "Array",
    "Grads",
    "OptState",
    "PRNGKey",
    "Params",
    "PyTree",
    "Tensor",
    "Updates",
    "__version__",
    "assert_trees_allclose",
    "autograd",
    "backward",
    "check_gradient",
    "config",
    "data",
    "distill",
    "distributed",
    "errors",
    "grad",
    "io",
    "lora",
    "merge",
    "nn",
    "no_grad",
    "optim",
    "preference",
    "quant",
    "runs",
    "train",
    "tree_bytes",
    "tree_named_leaves",
    "tree_size",
    "value_and_grad",
]
