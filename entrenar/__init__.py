"""entrenar: training and fine-tuning neural networks on JAX.

Layers, each importing only the ones below it::

    train          TrainState, jitted steps, Trainer, checkpoints (over data)
    distill        distillation losses (pure functions of logits and hidden states)
    lora quant     pytree transforms (LoRAWeight, QuantizedWeight nodes)
    nn  io         models as pure functions over param pytrees; file formats
    optim          (init, update) pairs, schedules, clipping
    autograd       Tensor, tape over jax.vjp, ops, gradient checking
    functional     value_and_grad / grad over pytrees; tree helpers; errors

Params are pytrees, transforms never mutate, randomness is an explicit ``key``.
"""

from entrenar import (
    autograd,
    data,
    distill,
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
from entrenar.functional import grad, value_and_grad
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
    "data",
    "distill",
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
