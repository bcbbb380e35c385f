"""Optimizers as pure state transitions, with schedules, clipping, masks, accumulation.

Protocol (optax's, so optax transformations work here and these work in optax)::

    tx = adamw(learning_rate=cosine_decay_schedule(1e-3, 10_000), weight_decay=0.01)
    state = tx.init(params)                              # NamedTuple <Name>State
    updates, state = tx.update(grads, state, params)     # pure, jit-friendly
    params = apply_updates(params, updates)

Optimizers are `chain`s of small pieces (`scale_by_adam`, `trace`,
`add_decayed_weights`, `scale_by_learning_rate`, `clip_by_global_norm`); the learning
rate lives in the state (`get_lr`, `set_lr`). `freeze` gives frozen leaves no update and
no state; `accumulate` averages ``k`` micro-batch gradients per step. `SGD`, `Adam`,
`AdamW` (and the 8-bit `Adam8bit`, `AdamW8bit`) wrap them for the Tensor API
(``opt.step(tensors)``). `OptimizerConfig` and
`ScheduleConfig` (a run's ``optimizer:`` and ``scheduler:``) build them by name from
the registries `OPTIMIZERS` and `SCHEDULES`. Math: specs/optimizers.md.
"""

from entrenar.optim.accumulation import (
    AccumulateState,
    accumulate,
    microbatched_value_and_grad,
)
from entrenar.optim.adam8bit import (
    Blockwise8bit,
    ScaleByAdam8bitState,
    dynamic_map,
    scale_by_adam_8bit,
)
from entrenar.optim.alias import (
    OPTIMIZERS,
    OptimizerConfig,
    adam,
    adam_8bit,
    adamw,
    adamw_8bit,
    sgd,
)
from entrenar.optim.base import (
    EmptyState,
    GradientTransformation,
    MaskedNode,
    apply_gradients,
    apply_updates,
    chain,
    identity,
    stateless,
)
from entrenar.optim.clipping import clip_by_global_norm, clip_grad_norm, global_norm
from entrenar.optim.hf_schedules import (
    cosine_with_min_lr_schedule,
    cosine_with_restarts_schedule,
    inverse_sqrt_schedule,
    polynomial_schedule,
    warmup_stable_decay_schedule,
)
from entrenar.optim.learning_rate import (
    LearningRateState,
    ScheduleState,
    get_lr,
    refresh_lr,
    scale,
    scale_by_learning_rate,
    set_lr,
)
from entrenar.optim.masking import (
    Mask,
    MaskedState,
    freeze,
    hf_decay_mask,
    masked,
    resolve_mask,
)
from entrenar.optim.schedule_config import SCHEDULES, ScheduleConfig
from entrenar.optim.schedules import (
    CosineScheduler,
    Schedule,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    step_decay,
    warmup,
    warmup_cosine_decay_schedule,
)
from entrenar.optim.stateful import SGD, Adam, Adam8bit, AdamW, AdamW8bit, Optimizer
from entrenar.optim.transforms import (
    ScaleByAdamState,
    TraceState,
    add_decayed_weights,
    map_updates,
    scale_by_adam,
    scale_by_momentum,
    trace,
)

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "SGD",
    "AccumulateState",
    "Adam",
    "Adam8bit",
    "AdamW",
    "AdamW8bit",
    "Blockwise8bit",
    "CosineScheduler",
    "EmptyState",
    "GradientTransformation",
    "LearningRateState",
    "Mask",
    "MaskedNode",
    "MaskedState",
    "Optimizer",
    "OptimizerConfig",
    "ScaleByAdam8bitState",
    "ScaleByAdamState",
    "Schedule",
    "ScheduleConfig",
    "ScheduleState",
    "TraceState",
    "accumulate",
    "adam",
    "adam_8bit",
    "adamw",
    "adamw_8bit",
    "add_decayed_weights",
    "apply_gradients",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "clip_grad_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_with_min_lr_schedule",
    "cosine_with_restarts_schedule",
    "dynamic_map",
    "exponential_decay",
    "freeze",
    "get_lr",
    "global_norm",
    "hf_decay_mask",
    "identity",
    "inverse_sqrt_schedule",
    "join_schedules",
    "linear_schedule",
    "map_updates",
    "masked",
    "microbatched_value_and_grad",
    "polynomial_schedule",
    "refresh_lr",
    "resolve_mask",
    "scale",
    "scale_by_adam",
    "scale_by_adam_8bit",
    "scale_by_learning_rate",
    "scale_by_momentum",
    "set_lr",
    "sgd",
    "stateless",
    "step_decay",
    "trace",
    "warmup",
    "warmup_cosine_decay_schedule",
    "warmup_stable_decay_schedule",
]
