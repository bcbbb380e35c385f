"""entrenar: training and fine-tuning neural networks on JAX.

Layers, each importing only the ones below it (specs/conventions.md; a test checks)::

    cli            the `entrenar` command (not imported here: ``python -m entrenar``)
    config         YAML -> frozen dataclasses -> train_from_yaml()
    train  chat    Trainer, jitted steps, checkpoints; chat inference
    data  merge    loaders, tokenizers, packing; TIES/DARE/SLERP model merging
    distributed    meshes, FSDP / data-parallel sharding rules, multi-host start-up
    lora  distill  LoRA/QLoRA pytree transforms; distillation losses
    io             JSON, YAML, safetensors, GGUF, tokenizer, SmolLM2
    autograd quant Tensor API over nn's math; QuantizedWeight formats
    nn  optim      models, layers, losses; (init, update) optimizers, schedules
    tree  gradients, errors, types

Params are pytrees, transforms never mutate, randomness is an explicit ``key``.
"""

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
    quant,
    train,
)
from entrenar.autograd import Tensor, backward, check_gradient, no_grad
from entrenar.gradients import grad, value_and_grad
from entrenar.tree import (
    assert_trees_allclose,
    tree_bytes,
    tree_named_leaves,
    tree_size,
)
from entrenar.types import Array, Grads, OptState, Params, PRNGKey, PyTree, Updates

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
    "quant",
    "train",
    "tree_bytes",
    "tree_named_leaves",
    "tree_size",
    "value_and_grad",
]
