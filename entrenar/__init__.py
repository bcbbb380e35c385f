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
import os
from typing import TYPE_CHECKING, Any

_CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
"""The XLA:CPU flag `entrenar` adds to ``XLA_FLAGS`` on import (`_cpu_scheduler`)."""


def _cpu_scheduler() -> None:
    """Compile CPU programs with XLA's memory-minimising (DFS) scheduler.

    XLA:CPU's default orders each program breadth-first for concurrency
    (``BFScheduler``): everything that depends only on parameters or constants
    runs first, so in a program of unrolled layers (DeepSeek's list,
    `entrenar.nn.deepseek`) every layer's zero-initialised scan buffers and
    rematerialised activations are alive at once, and the step's temporaries grow
    with depth (a tiny-but-wide 2 / 8-layer DeepSeek QLoRA step: 150 / 551 MB with
    it, 114 / 197 MB without; a scanned Qwen3-MoE's: 103 / 118 MB, 71 / 85 MB).
    XLA reads the flag once, from the environment, when its first backend starts
    (a per-compilation ``compiler_options`` entry is ignored on the CPU), so it is
    set here, where no JAX has been imported yet. A flag of the same name already
    in ``XLA_FLAGS`` (``=true`` brings the breadth-first order back) is left alone.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _CPU_SCHEDULER_FLAG.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_CPU_SCHEDULER_FLAG}".strip()


_cpu_scheduler()

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
