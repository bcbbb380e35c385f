"""Online GRPO: sample, score, step; TRL 1.16's ``GRPOTrainer`` loop on one host.

Each step (`GRPO.step`) takes ``P`` records (``prompt``: a text or a message
list; any other columns go to the reward functions):

1. tokenizes each prompt (message lists through the chat template with the
   generation prompt) and samples ``G = num_generations`` completions of each
   with `entrenar.nn.generate` (batched, KV cache, ``temperature``, ``top_p``,
   ``top_k``, at most ``max_completion_length`` tokens, ending at the tokenizer's
   EOS, which is kept), the key folded from the run's seed and the step;
2. scores the decoded completions with every reward function
   ``f(prompts, completions, **columns) -> list[float | None]`` (TRL's
   signature; None: not applicable, NaN in the per-function metric, 0 in the
   sum), sums them with ``reward_weights`` and forms the group advantages
   (`entrenar.preference.group_advantages`);
3. takes one optimizer step on the ``P·G`` rows (`make_grpo_loss_fn`): with one
   pass per generation ``π_old`` is the policy detached, as TRL's
   ``num_iterations=1``; the reference (``β > 0``) is the model with its LoRA
   adapters off, or the starting params kept aside for full fine-tuning.

The metrics of a step carry TRL's names: ``reward``, ``reward_std``,
``frac_reward_zero_std``, ``rewards/<name>/mean`` and ``/std``,
``completions/mean_length``, ``min_length``, ``max_length``, ``clipped_ratio``,
``mean_terminated_length``..., ``kl``, ``entropy``, ``clip_ratio/...``, and
``loss``, ``step_time``.

Built-in rewards for YAML runs (`builtin_reward`; no code is read from a file):

- ``exact_match`` (``column``): 1 when the completion, stripped, equals the
  record's ``column`` (stripped), else 0;
- ``contains`` (``column``): 1 when the record's ``column`` occurs in the completion;
- ``regex`` (``pattern``, ``fullmatch``): 1 when the pattern (at most 256
  characters, compiled once) matches the completion's first 4096 characters.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.chat.session import end_of_turn_ids
from entrenar.data.formatting import apply_chat_template
from entrenar.errors import ConfigError, FormatError, ShapeError
from entrenar.nn.generate import generate
from entrenar.preference.grpo import (
    GRPOLossType,
    ScaleRewards,
    check_grpo_settings,
    group_advantages,
)
from entrenar.preference.grpo_fn import make_grpo_loss_fn, pack_completions
from entrenar.preference.loss_fn import Reference, has_adapters
from entrenar.schema import Config, option
from entrenar.train import TrainState, make_train_step
from entrenar.types import Params

RewardFn = Callable[..., Sequence[float | None]]
"""``f(prompts, completions, **columns) -> one reward (or None) per completion``."""

MAX_PATTERN = 256
MAX_MATCHED_TEXT = 4096
EVAL_KEY = 1 << 31
"""Evaluation keys are folded from ``fold_in(key(seed), EVAL_KEY)`` (no step's)."""
LENGTH_BUCKET = 32
"""Packed rows are padded to a multiple of this many tokens (fewer compilations)."""


@dataclasses.dataclass(frozen=True)
class RewardSpec(Config):
    """One item of ``grpo.rewards``: a built-in reward (no code is read from YAML)."""

    type: Literal["exact_match", "contains", "regex"] = option(
        doc="exact_match (the stripped completion equals the record's column), "
        "contains (the column's text occurs in it) or regex (pattern matches)",
    )
    column: str | None = option(
        None, doc="the dataset column exact_match and contains compare with"
    )
    pattern: str | None = option(
        None, doc="regex's pattern (at most 256 characters; DOTALL)"
    )
    fullmatch: bool = option(
        False, doc="regex: the whole completion must match (else: search)"
    )
    weight: float = option(1.0, doc="its weight in the sum (TRL's reward_weights)")
    name: str | None = option(
        None, doc="the name of its metrics rewards/<name>/mean and /std"
    )

    def build(self) -> RewardFn:
        """The reward function (`builtin_reward`)."""
        if self.type == "regex":
            return builtin_reward(
                "regex", pattern=self.pattern, fullmatch=self.fullmatch, name=self.name
            )
        if self.pattern is not None:
            raise ConfigError(f"reward {self.type!r} reads column:, not pattern:")
        return builtin_reward(self.type, column=self.column, name=self.name)

    def check(self, path: str) -> None:
        """The reward builds (its options fit its type)."""
        try:
            self.build()
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class GRPOSettings(Config):
    """``grpo:``: online RL with verifiable rewards as TRL's GRPOTrainer computes it.

    The names and defaults are TRL 1.16's ``GRPOConfig``'s unless a field says.
    """

    rewards: tuple[RewardSpec, ...] = option(
        (),
        doc="built-in rewards of each completion, summed with their weights: a list "
        "of {type: exact_match | contains | regex, column, pattern, fullmatch, "
        "weight, name} (entrenar.preference.RewardSpec); a YAML run needs one",
    )
    num_generations: int = option(
        8, ge=2, doc="G: completions sampled per prompt (the group of the baseline)"
    )
    prompts_per_step: int = option(
        1,
        ge=1,
        doc="prompts per optimizer step, P·G completions (TRL: "
        "per_device_train_batch_size / num_generations)",
    )
    max_completion_length: int = option(
        256, ge=1, doc="at most this many new tokens per completion (TRL: 512)"
    )
    temperature: float = option(
        1.0, gt=0.0, doc="sampling temperature; the log-probs use the same"
    )
    top_p: float = option(1.0, gt=0.0, le=1.0, doc="nucleus sampling mass (1: off)")
    top_k: int = option(0, ge=0, doc="sample among the k likeliest (0: off)")
    beta: float = option(
        0.0,
        ge=0.0,
        doc="β: the k3 KL to the reference (the adapters off, or the starting "
        "weights kept aside); TRL's default 0: no reference",
    )
    epsilon: float = option(
        0.2, gt=0.0, lt=1.0, doc="ε: the ratio is clipped to [1 − ε, 1 + ε_high]"
    )
    epsilon_high: float | None = option(
        None, gt=0.0, doc="ε_high (DAPO's clip-higher); default ε"
    )
    loss_type: GRPOLossType = option(
        "dapo", doc="the aggregation of the per-token losses (TRL 1.16's default dapo)"
    )
    scale_rewards: ScaleRewards = option(
        "group",
        doc="advantages divided by the group's std, the batch's, or not (Dr. GRPO)",
    )
    use_bias_correction_kl: bool = option(
        True, doc="the k3 term times the ratio (TRL 1.16's default, DeepSeek-V3.2)"
    )
    reward_weights: tuple[float, ...] | None = option(
        None,
        yaml=False,
        doc="weights of the Python reward functions passed to GRPO (default 1)",
    )
    grad_accum: int = option(
        1, ge=1, yaml=False, doc="micro-batches per step (a run's training.grad_accum)"
    )

    def check(self, path: str) -> None:
        """The loss's settings, and micro-batches that divide a step's completions."""
        try:
            check_grpo_settings(
                beta=self.beta,
                epsilon=self.epsilon,
                epsilon_high=self.epsilon_high,
                loss_type=self.loss_type,
                max_completion_length=self.max_completion_length,
            )
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        rows = self.prompts_per_step * self.num_generations
        if rows % self.grad_accum:
            raise ConfigError(
                f"{path}: grad_accum {self.grad_accum} must divide the {rows} "
                f"completions of a step (prompts_per_step x num_generations)"
            )


def reward_metrics(scores: np.ndarray, names: Sequence[str]) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``/std`` of each function's ``(N, F)`` scores.

    NaN, where a function returned None, is left out.
    """
    out = {}
    s = np.asarray(scores, np.float64)
    for i, name in enumerate(names):
        col = s[:, i][~np.isnan(s[:, i])]
        out[f"rewards/{name}/mean"] = float(col.mean()) if col.size else math.nan
        out[f"rewards/{name}/std"] = (
            float(col.std(ddof=1)) if col.size > 1 else math.nan
        )
    return out


def completion_metrics(
    lengths: Sequence[int], ended: Sequence[bool]
) -> dict[str, float]:
    """TRL's ``completions/...``: lengths, and those that ended with EOS."""
    n = np.asarray(lengths, np.float64)
    done = np.asarray(ended, bool)
    term = n[done] if done.any() else np.zeros(1)
    return {
        "completions/mean_length": float(n.mean()),
        "completions/min_length": float(n.min()),
        "completions/max_length": float(n.max()),
        "completions/clipped_ratio": float(np.mean(~done)),
        "completions/mean_terminated_length": float(term.mean()),
        "completions/min_terminated_length": float(term.min()),
        "completions/max_terminated_length": float(term.max()),
    }


def builtin_reward(kind: str, *, name: str | None = None, **options: Any) -> RewardFn:
    """A reward named in a YAML run (module docstring): no code from the file.

    ``name`` names its metrics (``rewards/<name>/mean``); default ``regex``,
    ``exact_match_<column>``, ``contains_<column>``.
    """
    fn = _builtin(kind, **options)
    if name is not None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ConfigError(f"reward name {name!r}: letters, digits, _ . - only")
        fn.__name__ = name
    return fn


def _builtin(kind: str, **options: Any) -> RewardFn:
    if kind in ("exact_match", "contains"):
        column = options.pop("column", None)
        if not isinstance(column, str) or options:
            raise ConfigError(
                f"reward {kind!r} takes one option, column: <dataset column>; got "
                f"column={column!r} and {sorted(options)}"
            )

        def by_column(prompts: Any, completions: Sequence[str], **cols: Any) -> list:
            if column not in cols:
                raise ShapeError(
                    f"reward {kind!r} reads the column {column!r}, which the records "
                    f"lack (they have {sorted(cols)})"
                )
            want = [str(x).strip() for x in cols[column]]
            if kind == "exact_match":
                return [float(c.strip() == w) for c, w in zip(completions, want)]
            return [float(w in c) for c, w in zip(completions, want)]

        by_column.__name__ = f"{kind}_{column}"
        return by_column
    if kind == "regex":
        pattern = options.pop("pattern", None)
        full = bool(options.pop("fullmatch", False))
        if not isinstance(pattern, str) or options:
            raise ConfigError(
                f"reward 'regex' takes pattern: <regex> and fullmatch: <bool>; got "
                f"pattern={pattern!r} and {sorted(options)}"
            )
        if len(pattern) > MAX_PATTERN:
            raise ConfigError(f"regex pattern longer than {MAX_PATTERN} characters")
        try:
            rx = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ConfigError(f"regex pattern {pattern!r} does not compile: {e}") from e
        match = rx.fullmatch if full else rx.search

        def by_regex(prompts: Any, completions: Sequence[str], **cols: Any) -> list:
            return [float(match(c[:MAX_MATCHED_TEXT]) is not None) for c in completions]

        by_regex.__name__ = "regex"
        return by_regex
    raise ConfigError(
        f"unknown reward {kind!r}: the built-ins are exact_match, contains, regex "
        "(Python reward functions are passed to entrenar.preference.GRPO)"
    )


def _encode_prompt(tokenizer: Any, prompt: Any, chat_template: str | None) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, special=True))
    if isinstance(prompt, list) and all(isinstance(m, Mapping) for m in prompt):
        return apply_chat_template(
            tokenizer, prompt, add_generation_prompt=True, chat_template=chat_template
        )
    raise ShapeError(
        f"a GRPO record's prompt must be a text or a list of messages, got "
        f"{type(prompt).__name__}"
    )


def _stops_of(tokenizer: Any) -> list[int]:
    """The ids that end a completion.

    `entrenar.chat.end_of_turn_ids` when the tokenizer lists its tokens, else its
    EOS and ``stop_ids``.
    """
    if hasattr(tokenizer, "tokens") and hasattr(tokenizer, "token_types"):
        return list(end_of_turn_ids(tokenizer))
    eos = getattr(tokenizer, "eos_id", None)
    return [*([] if eos is None else [int(eos)]), *getattr(tokenizer, "stop_ids", ())]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class GRPO:
    """The online loop (module docstring) over a model, its params and rewards.

    Args:
        model: a Llama-style config (``features``, ``output_weight``,
            ``apply_cached``).
        params: the starting params (with `entrenar.lora` adapters for LoRA/QLoRA).
        optimizer: an ``(init, update)`` pair.
        tokenizer: ``encode``, ``decode``, ``eos_id``, ``pad_id`` (and a chat
            template for message prompts).
        rewards: Python reward functions (`RewardFn`, weighted by
            ``settings.reward_weights``); their ``__name__`` names the metrics.
            ``settings.rewards`` (built-ins) are added after them.
        settings: `GRPOSettings` (default: TRL's defaults).
        trainable: as `TrainState.create` (``"lora"`` trains the adapters only).
        seed: the run's seed (sampling keys, record order).
        stop_tokens: ids that end a completion; default the tokenizer's EOS,
            ``stop_ids`` and end-of-turn control tokens.
        chat_template: for message prompts; default the tokenizer's.
    """

    def __init__(
        self,
        model: Any,
        params: Params,
        optimizer: Any,
        tokenizer: Any,
        rewards: Sequence[RewardFn] = (),
        settings: GRPOSettings | None = None,
        *,
        trainable: Any = None,
        seed: int = 0,
        stop_tokens: Sequence[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        settings = GRPOSettings() if settings is None else settings
        weights = list(settings.reward_weights or (1.0,) * len(rewards))
        if len(weights) != len(rewards):
            raise ConfigError(
                f"{len(weights)} reward_weights for {len(rewards)} reward functions"
            )
        rewards = [*rewards, *(r.build() for r in settings.rewards)]
        weights += [r.weight for r in settings.rewards]
        if not rewards:
            raise ConfigError(
                "GRPO needs at least one reward: Python functions, or "
                "settings.rewards (built-ins)"
            )
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.optimizer = optimizer
        self.rewards, self.weights = list(rewards), np.asarray(weights, np.float64)
        self.names = [
            getattr(f, "__name__", f"reward_{i}") for i, f in enumerate(rewards)
        ]
        self.seed, self.chat_template = seed, chat_template
        eos = getattr(tokenizer, "eos_id", None)
        if stop_tokens is None:  # EOS, the generation config's, end-of-turn tokens
            stop_tokens = _stops_of(tokenizer)
        self.stop_tokens = list(dict.fromkeys(int(t) for t in stop_tokens))
        pad = getattr(tokenizer, "pad_id", None)
        self.pad_id = int(pad if pad is not None else (eos if eos is not None else 0))
        self.reference: Reference = (
            "adapters" if has_adapters(params) else "precomputed"
        )
        self.ref_params = (
            params if settings.beta and self.reference == "precomputed" else None
        )
        loss_fn = make_grpo_loss_fn(
            model, beta=settings.beta, epsilon=settings.epsilon,
            epsilon_high=settings.epsilon_high, loss_type=settings.loss_type,
            temperature=settings.temperature, reference=self.reference,
            max_completion_length=settings.max_completion_length,
            use_bias_correction_kl=settings.use_bias_correction_kl,
        )  # fmt: skip
        self._train_step = make_train_step(
            loss_fn, optimizer, grad_accum=settings.grad_accum
        )
        self.state = TrainState.create(
            params, optimizer, key=jax.random.key(seed), trainable=trainable
        )
        self.history: list[dict[str, float]] = []
        self.eval_history: list[dict[str, float]] = []  # for `state_dict`
        self._permutations = 0  # the prompt order (`next_prompts`)
        self._queue: list[int] = []
        self._rng = np.random.default_rng(seed)
        self._ref_logps = None
        if self.ref_params is not None:
            from entrenar.preference.grpo_fn import token_logps

            self._ref_logps = jax.jit(token_logps, static_argnums=(0, 5))

    @property
    def params(self) -> Params:
        """The current params (trainable and frozen together)."""
        return self.state.params

    def sample(
        self, prompt_ids: Sequence[Sequence[int]], step: int, key: Any = None
    ) -> list[list[int]]:
        """``G`` completions of each prompt, EOS kept, padding dropped.

        ``key``: default ``fold_in(key(seed), step)``, step ``step``'s.
        """
        s = self.settings
        rows = [list(p) for p in prompt_ids for _ in range(s.num_generations)]
        if key is None:
            key = jax.random.fold_in(jax.random.key(self.seed), step)
        out = np.asarray(generate(
            self.model, self.params, rows, max_new_tokens=s.max_completion_length,
            key=key, temperature=s.temperature, top_p=s.top_p if s.top_p < 1 else None,
            top_k=s.top_k or None, stop_tokens=self.stop_tokens, pad_token=self.pad_id,
            vocab_limit=getattr(self.tokenizer, "vocab_size", None),
        ))  # fmt: skip  # (B, N)
        stops = set(self.stop_tokens)
        completions = []
        for r in out:
            ends = [i for i, t in enumerate(r.tolist()) if t in stops]
            completions.append(r[: ends[0] + 1].tolist() if ends else r.tolist())
        return completions

    def score(
        self,
        records: Sequence[Mapping[str, Any]],
        completions: Sequence[str],
        completion_ids: Sequence[Sequence[int]],
    ) -> np.ndarray:
        """``(P·G, F)`` rewards of each completion by each function (NaN for None).

        Each function gets ``prompts``, ``completions`` (texts), ``completion_ids``
        and the records' other columns, one entry per completion, as in TRL.
        """
        g = self.settings.num_generations
        rows = [r for r in records for _ in range(g)]
        prompts = [r["prompt"] for r in rows]
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
        columns.pop("completion_ids", None)
        scores = np.zeros((len(rows), len(self.rewards)))
        for j, f in enumerate(self.rewards):
            out = list(f(prompts=prompts, completions=list(completions),
                         completion_ids=[list(c) for c in completion_ids],
                         **columns))  # fmt: skip
            if len(out) != len(rows):
                raise ShapeError(
                    f"reward {self.names[j]!r} returned {len(out)} rewards for "
                    f"{len(rows)} completions"
                )
            scores[:, j] = [math.nan if v is None else float(v) for v in out]
        return scores

    def _encode(self, records: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return [_encode_prompt(self.tokenizer, r["prompt"], self.chat_template)
                for r in records]  # fmt: skip

    def _rewards(
        self,
        records: Sequence[Mapping[str, Any]],
        completions: Sequence[Sequence[int]],
    ) -> tuple[np.ndarray, dict[str, float]]:
        """The advantages of ``completions`` and their reward / length metrics."""
        s = self.settings
        texts = [self.tokenizer.decode(c) for c in completions]
        scores = self.score(records, texts, completions)
        total = np.nansum(scores * self.weights, axis=1)
        unscorable = np.isnan(scores).all(axis=1)
        total[unscorable] = np.nan
        adv, metrics = group_advantages(total, s.num_generations, s.scale_rewards)
        metrics.update(reward_metrics(scores, self.names))
        stops = set(self.stop_tokens)
        metrics.update(completion_metrics(
            [len(c) for c in completions],
            [bool(c) and c[-1] in stops for c in completions],
        ))  # fmt: skip
        return adv, metrics

    def evaluate(
        self, records: Sequence[Mapping[str, Any]], step: int
    ) -> dict[str, float]:
        """The rewards of ``G`` completions of each of ``records``, TRL's ``eval_``.

        Sampled as in training (``prompts_per_step`` prompts at a time) from the
        current params, with keys of their own: ``fold_in(fold_in(fold_in(
        key(seed), 2³¹), step), chunk)``, so an evaluation is the same whenever
        its step is (a resumed run's too) and draws no key of a training step.
        The metrics are those of a step's sampling and scoring (``reward``,
        ``reward_std``, ``frac_reward_zero_std``, ``rewards/<name>/mean``,
        ``completions/...``) over all of ``records`` at once, named ``eval_...``
        as TRL's evaluation logs them; no loss.
        """
        p = self.settings.prompts_per_step
        root = jax.random.fold_in(
            jax.random.fold_in(jax.random.key(self.seed), EVAL_KEY), step
        )
        completions: list[list[int]] = []
        for n, i in enumerate(range(0, len(records), p)):
            ids = self._encode(records[i : i + p])
            completions += self.sample(ids, step, jax.random.fold_in(root, n))
        _, metrics = self._rewards(records, completions)
        return {f"eval_{k}": v for k, v in metrics.items()}

    def step(self, records: Sequence[Mapping[str, Any]], step: int) -> dict[str, float]:
        """Sample, score and take one optimizer step; return the step's metrics."""
        start = time.perf_counter()
        s = self.settings
        prompt_ids = self._encode(records)
        completions = self.sample(prompt_ids, step)
        adv, metrics = self._rewards(records, completions)
        rows = [p for p in prompt_ids for _ in range(s.num_generations)]
        longest = max(len(p) + len(c) for p, c in zip(rows, completions))
        packed = pack_completions(rows, completions, self.pad_id,
                                  _round_up(longest, LENGTH_BUCKET))  # fmt: skip
        batch: dict[str, jax.Array] = {k: jnp.asarray(v) for k, v in packed.items()}
        batch["advantages"] = jnp.asarray(adv, jnp.float32)
        if self._ref_logps is not None:
            batch["ref_logps"] = self._ref_logps(
                self.model, self.ref_params, batch["input_ids"],
                batch["attention_mask"], batch["completion_mask"], s.temperature,
            )  # fmt: skip
        self.state, step_metrics = self._train_step(self.state, batch)
        step_metrics.pop("loss_weight", None)
        metrics.update({k: float(v) for k, v in step_metrics.items()})
        metrics["step_time"] = time.perf_counter() - start
        return metrics

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken (the state's step)."""
        return int(self.state.step)

    def next_prompts(self, count: int, p: int) -> list[int]:
        """The indices of the next ``p`` of ``count`` records.

        The records are shuffled with the seed, one permutation after another (a
        generator seeded once, ``numpy.random.default_rng(seed)``); a step takes
        the ``p`` next indices, crossing into the next permutation when fewer are
        left.
        """
        while len(self._queue) < p:
            self._queue += self._rng.permutation(count).tolist()
            self._permutations += 1
        take, self._queue = self._queue[:p], self._queue[p:]
        return take

    def state_dict(self) -> dict[str, Any]:
        """What the next step depends on besides `state` (JSON: a checkpoint's meta).

        The prompt order (permutations drawn, indices left), the history and the
        evaluations' (kept by the caller in ``eval_history``). The
        sampling key is ``fold_in(key(seed), step)``: the state's step gives it;
        the built-in rewards keep no state (Python reward functions' own state,
        if any, is theirs to save).
        """
        return {
            "step": self.steps_taken,
            "seed": self.seed,
            "permutations": self._permutations,
            "queue": list(self._queue),
            "history": list(self.history),
            "eval_history": list(self.eval_history),
        }

    def load_state_dict(self, meta: Mapping[str, Any], count: int) -> None:
        """Continue the prompt order and history of `state_dict` over ``count`` records.

        The generator is replayed (``permutations`` draws of ``count``), so the
        next permutation is the uninterrupted run's.

        Raises:
            FormatError: ``meta`` is not a `state_dict`, or its indices do not fit
                ``count`` records (another data file under the same name).
        """
        try:
            drawn, queue = int(meta["permutations"]), [int(i) for i in meta["queue"]]
            history = [dict(m) for m in meta["history"]]
            evals = [dict(m) for m in meta.get("eval_history", [])]
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(
                f"a GRPO checkpoint's meta needs permutations, queue and history: {e}"
            ) from None
        if any(not 0 <= i < count for i in queue) or drawn < 0:
            raise FormatError(
                f"the GRPO checkpoint's prompt order does not fit {count} records "
                "(the data file changed since it was written?)"
            )
        self._rng = np.random.default_rng(self.seed)
        for _ in range(drawn):
            self._rng.permutation(count)
        self._permutations, self._queue, self.history = drawn, queue, history
        self.eval_history = evals

    def train(
        self,
        records: Sequence[Mapping[str, Any]],
        steps: int,
        *,
        metrics_path: str | Path | None = None,
        log: Callable[[dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Take ``steps`` more steps over ``records``, in `next_prompts`'s order.

        Each step's metrics are appended to ``history`` and ``metrics_path`` (JSON
        lines), then passed to ``log``; returns this call's steps' metrics. Calls
        continue one another (the step count, prompt order and sampling keys).
        """
        p = self.settings.prompts_per_step
        if len(records) < p:
            raise ShapeError(f"{len(records)} records for {p} prompts per step")
        out = []
        for _ in range(steps):
            i = self.steps_taken
            take = self.next_prompts(len(records), p)
            m = {"step": i + 1, **self.step([records[j] for j in take], i)}
            self.history.append(m)
            out.append(m)
            if metrics_path is not None:
                with open(metrics_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(m) + "\n")
            if log is not None:
                log(m)
        return out


__all__ = [
    "GRPO",
    "GRPOSettings",
    "RewardFn",
    "RewardSpec",
    "builtin_reward",
    "completion_metrics",
    "reward_metrics",
]
