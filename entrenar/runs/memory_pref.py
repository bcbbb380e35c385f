"""The ``step`` part of `plan_memory` for preference runs: DPO and GRPO.

Each phase of the run's loop that holds memory beside the model, the trainable
copy and the optimizer state is one compiled program; its bytes are XLA's buffer
assignment of that program on `jax.ShapeDtypeStruct` arguments (``temp +
arguments not already counted + outputs not aliased to donated inputs``), and the
plan's ``step`` is the largest phase (they run one after another):

DPO (``preference:``, `entrenar.preference.make_dpo_loss_fn`):

- the train step on ``(B, 2, T)`` pairs (``B = data.batch_size × grad_accum``,
  ``T = data.seq_len``, the longest row the collator can keep), which the loss
  runs as ``2B`` rows: the policy's forward and backward, and with
  ``reference: adapters`` the reference's forward in the same program under
  ``stop_gradient`` (the tree with its adapters off: nothing of it is saved for
  the backward, so XLA frees its activations as the chunked head consumes them);
  with ``reference: precomputed`` the batch carries ``(B,)`` log-prob arrays
  instead;
- ``precomputed`` (full fine-tuning): the pass before training,
  `entrenar.runs.run.with_reference_logps`, ``data.batch_size`` pairs at a time
  (its ``(N,)`` results, 8 bytes a pair, are the data's).

GRPO (``grpo:``, `entrenar.preference.GRPO.step`), ``R = P·G`` rows (prompts per
step × generations), ``S`` the longest prompt of ``data.train`` in tokens (as the
loop encodes it: `longest_prompt`; the run does not cut prompts) and
``C = max_completion_length``:

- generation (`entrenar.nn.generate`): the KV cache of ``R`` rows of
  ``round_up(S + C, 32)`` positions (capped at the context), and the larger of
  the prefill's and one decoding step's own buffers (the cache is donated);
- with ``β > 0`` and no adapters, the reference's per-token log-probs of the
  ``(R, T)`` rows (``T = round_up(S + C, 32)``), a forward of the starting params;
- the train step on those rows (`entrenar.preference.make_grpo_loss_fn`: the
  policy's forward and backward, the reference's forward with the adapters off
  when ``β > 0``, the entropies one row's ``(T, V)`` logits at a time).

GRPO's loop steps its own `TrainState` (no bfloat16 copy of the frozen half:
`entrenar.runs.memory_plan` counts none).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from entrenar import data as data_lib
from entrenar.config.spec import TrainSpec
from entrenar.errors import UnsupportedError
from entrenar.nn.generate import CACHE_BUCKET, context_length, decode_step, prefill
from entrenar.nn.sampling import Sampling
from entrenar.preference import (
    has_adapters,
    make_dpo_loss_fn,
    make_grpo_loss_fn,
    reference_logps,
    token_logps,
)
from entrenar.preference.grpo_run import LENGTH_BUCKET, _encode_prompt  # the loop's
from entrenar.preference.loss_fn import Reference
from entrenar.runs.build import train_config
from entrenar.runs.models import BuiltModel
from entrenar.train.model_loss import with_compute_dtype
from entrenar.train.step import make_train_step
from entrenar.tree import tree_bytes

GRPO_EXTRA_BYTES = 160_000_000
"""What a GRPO run holds beyond a Trainer run's fixed parts: more executables
(generation's prefill and decoding step, the reference pass, and the train step
again for each new packed length: rows are padded to a multiple of 32 tokens, so a
step whose longest completion lands in another bucket compiles anew) and
matplotlib for reward.png after the last step. Measured on a 2-layer Llama with
LoRA, two steps: 0.53 GB after the first, 0.56 GB after the second, 0.59 GB after
the plot (+31 MB); five runs peaked at 0.58-0.61 GB, over a plan of 0.545 GB
without this part. Since GRPO runs write checkpoints and config.json and can
evaluate (the end-of-run checkpoint and the evaluation programs), the same test's
LoRA and NF4 runs peaked up to 8 MB over the 0.10 GB this part first had, and the
NF4 run alone, over five runs, 0.652-0.692 GB, up to 17 MB over 0.13 GB: 0.16 GB
(a fixed part: at real shapes the KV cache and the step dominate)."""


DPO_EXTRA_BYTES = 40_000_000
"""What a DPO run with ``reference: adapters`` holds beyond a Trainer run's fixed
parts: its step is a larger program (the reference's forward and chunked head
beside the policy's forward and backward) and the fixed parts spread from run to
run: the test's 2-layer LoRA/QLoRA runs peaked at 0.52-0.57 GB in 11 fresh
processes and once, under pytest, over the 0.579 GB planned without this part."""


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _own_bytes(compiled: Any, args: Any = ()) -> int:
    """``temp + bytes(args) + output − alias`` of a compiled program.

    ``args``: the arguments that exist only for this program (a batch); the
    model's tree and the state are the plan's other parts.
    """
    m = compiled.memory_analysis()
    if m is None:
        raise UnsupportedError(
            f"the {jax.default_backend()} backend reports no memory analysis of the "
            "compiled step: the memory predictor cannot run here; remove max_memory"
        )
    out = int(m.output_size_in_bytes) - int(m.alias_size_in_bytes)
    return int(m.temp_size_in_bytes) + tree_bytes(args) + max(out, 0)


def _ints(*shape: int, dtype: Any = np.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _train_step_bytes(
    spec: TrainSpec, loss_fn: Any, optimizer: Any, state: Any, frozen: Any,
    batch: dict[str, Any], *, trainer: bool,
) -> int:  # fmt: skip
    """The train step's own bytes (`make_train_step` as the run builds it).

    ``trainer``: the Trainer's step (clip, compute dtype, non-finite skip), else
    GRPO's (`make_train_step` with ``grad_accum`` alone).
    """
    step: Any  # its `jitted` program, lowered on shapes
    if trainer:
        cfg = train_config(spec, progress=False)
        step = make_train_step(
            with_compute_dtype(loss_fn, cfg.compute_dtype), optimizer,
            grad_accum=cfg.grad_accum, clip=cfg.grad_clip, skip_nonfinite=True,
        )  # fmt: skip
    else:
        step = make_train_step(loss_fn, optimizer, grad_accum=spec.training.grad_accum)
    compiled = step.jitted.lower(
        state.trainable, state.opt_state, frozen, state.step, state.key, batch
    ).compile()
    return _own_bytes(compiled, batch)


def dpo_step(
    spec: TrainSpec, built: BuiltModel, params: Any, optimizer: Any, state: Any,
    frozen: Any,
) -> tuple[int, str]:  # fmt: skip
    """``(bytes, description)`` of a DPO run's largest phase (module docstring)."""
    p, d = spec.preference, spec.data
    assert p is not None and d is not None
    model = built.config
    reference = p.reference
    if reference == "auto":
        reference = "adapters" if has_adapters(params) else "precomputed"
    loss_fn = make_dpo_loss_fn(
        model, beta=p.beta, loss_type=p.loss_type, label_smoothing=p.label_smoothing,
        reference=reference, disable_dropout=p.disable_dropout,
    )  # fmt: skip
    pairs, t = d.batch_size * spec.training.grad_accum, d.seq_len
    keys = ("input_ids", "attention_mask", "completion_mask")
    batch: dict[str, Any] = {k: _ints(pairs, 2, t) for k in keys}
    if reference == "precomputed":
        for k in ("ref_chosen_logps", "ref_rejected_logps"):
            batch[k] = _ints(pairs, dtype=np.float32)
    step = _train_step_bytes(spec, loss_fn, optimizer, state, frozen, batch,
                             trainer=True)  # fmt: skip
    what = (
        f"DPO: {pairs} pairs x {t} as {2 * pairs} rows, reference {reference}; "
        f"remat {model.remat_policy or 'none'}, "
        f"matmul {model.matmul_dtype or 'float32'}"
    )
    if reference != "precomputed":
        return step, f"gradients, activations, temporaries ({what})"
    part = {k: v for k, v in batch.items() if not k.startswith("ref_")}
    part = {k: _ints(d.batch_size, 2, t) for k in part}
    ref = jax.jit(lambda q, b: reference_logps(model, q, b)).lower(params, part)
    ref_bytes = _own_bytes(ref.compile(), part)
    return max(step, ref_bytes), (
        f"the larger of the train step {_gb(step)} and the reference pass before "
        f"training {_gb(ref_bytes)} ({what})"
    )


def preference_extra(spec: TrainSpec, params: Any) -> int:
    """Bytes a preference run's programs add to the compiler part (0: not one).

    `GRPO_EXTRA_BYTES` for GRPO, `DPO_EXTRA_BYTES` for DPO with the adapters off
    as the reference (``reference: adapters``, or ``auto`` with LoRA).
    """
    if spec.grpo is not None:
        return GRPO_EXTRA_BYTES
    p = spec.preference
    if p is None or p.reference == "precomputed":
        return 0
    return DPO_EXTRA_BYTES if has_adapters(params) else 0


def longest_prompt(spec: TrainSpec, built: BuiltModel) -> int:
    """Tokens of ``data.train``'s longest prompt as the GRPO loop encodes it.

    Texts as they are, message lists through the chat template with the generation
    prompt (`entrenar.preference.grpo_run`); ``data.seq_len`` without a tokenizer.
    """
    d = spec.data
    assert d is not None
    tok = built.tokenizer
    if tok is None:
        return d.seq_len
    return max(
        (len(_encode_prompt(tok, r["prompt"], None))
         for r in data_lib.load_records(d.train) if "prompt" in r),
        default=d.seq_len,
    )  # fmt: skip


def grpo_shapes(spec: TrainSpec, built: BuiltModel) -> tuple[int, int, int, int]:
    """``(rows, prompt, cache length, packed length)`` of a GRPO step's arrays."""
    g = spec.grpo
    assert g is not None
    rows, prompt = g.prompts_per_step * g.num_generations, longest_prompt(spec, built)
    cache = -(-(prompt + g.max_completion_length) // CACHE_BUCKET) * CACHE_BUCKET
    cache = min(cache, context_length(built.config) or cache)
    packed = -(-(prompt + g.max_completion_length) // LENGTH_BUCKET) * LENGTH_BUCKET
    return rows, prompt, cache, packed


def _generation_bytes(
    spec: TrainSpec, built: BuiltModel, params: Any, rows: int, prompt: int, n: int
) -> tuple[int, int]:
    """``(bytes, cache bytes)`` of sampling ``rows`` completions (`generate`)."""
    g = spec.grpo
    assert g is not None
    model = built.config
    vocab = getattr(built.tokenizer, "vocab_size", None)
    top_p = g.top_p if g.top_p < 1 else None
    sampling = Sampling(g.temperature, g.top_k or None, top_p, None, None, vocab)
    structure, values = sampling.structure(), sampling.values()
    cache = jax.eval_shape(lambda: model.init_cache(rows, n))
    cache = cache._replace(pos=_ints(rows))  # ragged prompts: a position per row
    key = jax.eval_shape(lambda: jax.random.key(0))
    stops = np.zeros((1,), np.int32)
    tb = min(-(-prompt // 32) * 32, n)
    ids, lens = _ints(rows, tb), _ints(rows)
    pre = prefill.lower(
        model, params, ids, lens, cache, key, values, stops, np.zeros((0,), np.int32),
        structure=structure, rewind=True,
    ).compile()  # fmt: skip
    dec = decode_step.lower(
        model, params, lens, cache, None, _ints(rows, dtype=np.bool_), key,
        _ints(), values, stops, _ints(), structure=structure,
    ).compile()  # fmt: skip
    held = tree_bytes(cache)
    return held + max(_own_bytes(pre, (ids, lens)), _own_bytes(dec)), held


def grpo_step(
    spec: TrainSpec, built: BuiltModel, params: Any, optimizer: Any, state: Any
) -> tuple[int, str]:
    """``(bytes, description)`` of a GRPO run's largest phase (module docstring)."""
    g = spec.grpo
    assert g is not None
    model = built.config
    rows, prompt, n, t = grpo_shapes(spec, built)
    reference: Reference = "adapters" if has_adapters(params) else "precomputed"
    loss_fn = make_grpo_loss_fn(
        model, beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
        loss_type=g.loss_type, temperature=g.temperature, reference=reference,
        max_completion_length=g.max_completion_length,
        use_bias_correction_kl=g.use_bias_correction_kl,
    )  # fmt: skip
    batch: dict[str, Any] = {
        k: _ints(rows, t) for k in ("input_ids", "attention_mask", "completion_mask")
    }
    batch["advantages"] = _ints(rows, dtype=np.float32)
    ref_bytes = 0
    if g.beta and reference == "precomputed":  # the starting params' log-probs
        fn = jax.jit(token_logps, static_argnums=(0, 5))
        args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        ref = fn.lower(model, params, *args, g.temperature).compile()
        ref_bytes = _own_bytes(ref, args)
        batch["ref_logps"] = _ints(rows, t - 1, dtype=np.float32)
    step = _train_step_bytes(spec, loss_fn, optimizer, state, state.frozen, batch,
                             trainer=False)  # fmt: skip
    gen, cache = _generation_bytes(spec, built, params, rows, prompt, n)
    phases = f"generation {_gb(gen)} (KV cache {_gb(cache)}: {rows} rows x {n})"
    if ref_bytes:
        phases += f", reference log-probs {_gb(ref_bytes)}"
    phases += f", train step {_gb(step)} ({rows} rows x {t})"
    return max(gen, ref_bytes, step), f"GRPO, the largest of {phases}"


__all__ = [
    "DPO_EXTRA_BYTES",
    "GRPO_EXTRA_BYTES",
    "dpo_step",
    "grpo_shapes",
    "grpo_step",
    "longest_prompt",
    "preference_extra",
]
