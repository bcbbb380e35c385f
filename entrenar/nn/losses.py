"""Losses as pure jnp functions, shared by models, Tensor API, Trainer, distillation.

Every loss takes arrays, computes in float32 (float64 inputs stay float64), and reduces
with ``reduction``: ``"mean"`` (over the valid elements when a mask or ``ignore_index``
is given), ``"sum"`` or ``"none"`` (elementwise, masked entries zero). Class-indexed
losses (`cross_entropy`, `causal_lm_loss`, `kl_divergence`) work on logits of shape
``(..., C)`` through a numerically stable ``log_softmax``.

Conventions (PyTorch's, so users' habits carry over):

- integer targets equal to ``ignore_index`` (default -100) count neither in the sum nor
  in the mean; the mean over no valid element is 0;
- `causal_lm_loss` takes ``labels`` aligned with the input tokens (Hugging Face's
  convention) and shifts inside: position ``t``'s logits predict ``labels[t + 1]``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.bf16_weight import Bfloat16Weight, TiedEmbedding
from entrenar.nn.linear import linear
from entrenar.nn.softmax_xent import nll_and_lse, softmax_minus_onehot, softmax_xent

Reduction = Literal["mean", "sum", "none"]
IGNORE_INDEX = -100


def _float(x: jax.Array) -> jax.Array:
    """``x`` as float32, or float64 when it already is."""
    x = jnp.asarray(x)
    return x if x.dtype == jnp.float64 else x.astype(jnp.float32)


def check_reduction(reduction: str) -> None:
    """Raise `ConfigError` unless ``reduction`` is "mean", "sum" or "none"."""
    if reduction not in ("mean", "sum", "none"):
        raise ConfigError(
            f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
        )


def reduce_loss(
    values: jax.Array, reduction: str = "mean", *, where: jax.Array | None = None
) -> jax.Array:
    """Reduce elementwise ``values`` by ``reduction`` over the entries where ``where``.

    ``"mean"`` divides by the number of valid entries (at least 1, so an all-masked
    batch gives 0, not NaN); ``"none"`` returns ``values`` with masked entries zeroed.

    >>> reduce_loss(jnp.array([1.0, 2.0, 6.0]), where=jnp.array([True, True, False]))
    Array(1.5, dtype=float32)
    """
    check_reduction(reduction)
    if where is not None:
        where = jnp.broadcast_to(jnp.asarray(where, bool), values.shape)
        values = jnp.where(where, values, jnp.zeros_like(values))
    if reduction == "none":
        return values
    total = jnp.sum(values)
    if reduction == "sum":
        return total
    count = values.size if where is None else jnp.sum(where)
    return total / jnp.maximum(count, 1).astype(values.dtype)


# ---- regression ------------------------------------------------------------------
def mse(
    pred: jax.Array,
    target: jax.Array,
    reduction: Reduction = "mean",
    *,
    where: jax.Array | None = None,
) -> jax.Array:
    """Mean squared error ``(pred - target)²``.

    >>> mse(jnp.array([1.0, 3.0]), jnp.array([0.0, 1.0]))
    Array(2.5, dtype=float32)
    """
    diff = _float(pred) - _float(target)
    return reduce_loss(jnp.square(diff), reduction, where=where)


def l1(
    pred: jax.Array,
    target: jax.Array,
    reduction: Reduction = "mean",
    *,
    where: jax.Array | None = None,
) -> jax.Array:
    """Mean absolute error ``|pred - target|``.

    >>> l1(jnp.array([1.0, 3.0]), jnp.array([0.0, 1.0]))
    Array(1.5, dtype=float32)
    """
    diff = _float(pred) - _float(target)
    return reduce_loss(jnp.abs(diff), reduction, where=where)


def huber(
    pred: jax.Array,
    target: jax.Array,
    delta: float = 1.0,
    reduction: Reduction = "mean",
    *,
    where: jax.Array | None = None,
) -> jax.Array:
    """Huber loss (Huber, 1964): quadratic within ``delta`` of the target, linear out.

    ``½ r²`` if ``|r| ≤ δ`` else ``δ (|r| - ½ δ)``, with ``r = pred - target``
    (PyTorch's ``HuberLoss``; ``delta = 1`` is ``smooth_l1_loss``).

    >>> huber(jnp.array([0.5, 3.0]), jnp.zeros(2), reduction="none").tolist()
    [0.125, 2.5]
    """
    if not delta > 0:
        raise ConfigError(f"huber delta must be > 0, got {delta}")
    r = jnp.abs(_float(pred) - _float(target))
    d = jnp.asarray(delta, r.dtype)
    values = jnp.where(r <= d, 0.5 * r * r, d * (r - 0.5 * d))
    return reduce_loss(values, reduction, where=where)


# ---- classification --------------------------------------------------------------
def binary_cross_entropy_with_logits(
    logits: jax.Array,
    targets: jax.Array,
    reduction: Reduction = "mean",
    *,
    where: jax.Array | None = None,
) -> jax.Array:
    """``-[y log σ(x) + (1 - y) log(1 - σ(x))]``, stable for large ``|x|``.

    Computed as ``max(x, 0) - x y + log(1 + e^{-|x|})``.

    >>> round(float(binary_cross_entropy_with_logits(jnp.zeros(1), jnp.ones(1))), 4)
    0.6931
    """
    x, y = _float(logits), _float(targets)
    values = jnp.maximum(x, 0) - x * y + jnp.log1p(jnp.exp(-jnp.abs(x)))
    return reduce_loss(values, reduction, where=where)


def _check_class_targets(logits: jax.Array, targets: jax.Array) -> None:
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ShapeError(
            f"targets {tuple(targets.shape)} must equal logits' shape without its "
            f"class axis {tuple(logits.shape[:-1])} (logits {tuple(logits.shape)})"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ShapeError(f"class targets must be integers, got dtype {targets.dtype}")


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    reduction: Reduction = "mean",
    *,
    ignore_index: int = IGNORE_INDEX,
    where: jax.Array | None = None,
    label_smoothing: float = 0.0,
) -> jax.Array:
    """Softmax cross-entropy with integer targets: ``-log softmax(logits)[target]``.

    Entries whose target is ``ignore_index``, or where ``where`` is False, are left
    out of the sum and of the mean. With ``label_smoothing = ε`` the target
    distribution is ``(1 - ε)·onehot + ε/C`` (Szegedy et al., 2016).

    Args:
        logits: ``(..., C)``, any float dtype (computed in float32 or float64).
        targets: integer ``(...)``.
        reduction: "mean" over valid entries, "sum", or "none" (``(...)``).
        ignore_index: target value to skip.
        where: optional bool ``(...)``, False to skip an entry.
        label_smoothing: ε in [0, 1).

    >>> round(float(cross_entropy(jnp.array([[0.0, 0.0]]), jnp.array([1]))), 4)
    0.6931
    """
    targets = jnp.asarray(targets)
    _check_class_targets(logits, targets)
    if not 0.0 <= label_smoothing < 1.0:
        raise ConfigError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    logp = jax.nn.log_softmax(_float(logits), axis=-1)  # (..., C)
    valid = targets != ignore_index  # (...)
    if where is not None:
        valid = valid & jnp.asarray(where, bool)
    safe = jnp.where(valid, targets, 0)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]  # (...)
    if label_smoothing:
        eps = jnp.asarray(label_smoothing, logp.dtype)
        nll = (1 - eps) * nll - eps * jnp.mean(logp, axis=-1)
    return reduce_loss(nll, reduction, where=valid)


def causal_lm_loss(
    logits: jax.Array,
    labels: jax.Array,
    reduction: Reduction = "mean",
    *,
    ignore_index: int = IGNORE_INDEX,
    loss_mask: jax.Array | None = None,
) -> jax.Array:
    """Next-token cross-entropy: position ``t``'s logits predict ``labels[t + 1]``.

    ``labels`` are aligned with the input tokens, ``(B, T)``, as in Hugging Face
    (usually the input ids themselves). Positions to leave out — padding, the prompt
    of a prompt/completion pair, the first token of each packed document — carry
    ``ignore_index`` in ``labels`` or False in ``loss_mask`` (both aligned with the
    labels: the mask at ``t + 1`` says whether predicting ``labels[t + 1]`` counts).

    Args:
        logits: ``(B, T, V)``.
        labels: integer ``(B, T)``.
        reduction: "mean" over counted tokens, "sum", or "none" (``(B, T - 1)``).
        ignore_index: label value to skip.
        loss_mask: optional bool ``(B, T)``.

    >>> logits = jnp.zeros((1, 3, 4))
    >>> round(float(causal_lm_loss(logits, jnp.array([[0, 1, 2]]))), 4)  # log 4
    1.3863
    """
    if logits.ndim != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ShapeError(
            f"causal_lm_loss needs logits (B, T, V) and labels (B, T); got logits "
            f"{tuple(logits.shape)} and labels {tuple(jnp.shape(labels))}"
        )
    where = None if loss_mask is None else jnp.asarray(loss_mask, bool)[:, 1:]
    return cross_entropy(
        logits[:, :-1],  # (B, T-1, V)
        jnp.asarray(labels)[:, 1:],  # (B, T-1)
        reduction,
        ignore_index=ignore_index,
        where=where,
    )


def segment_labels(
    labels: jax.Array, segment_ids: jax.Array, *, ignore_index: int = IGNORE_INDEX
) -> jax.Array:
    """``labels`` with ``ignore_index`` where a packed row starts a new segment.

    In a packed row (``segment_ids (B, T)``) position ``t`` attends only to its own
    document, so the target ``labels[t + 1]`` is no target when
    ``segment_ids[t + 1] ≠ segment_ids[t]``: it is the next document's first token.
    The data pipeline already writes ``-100`` there; labels defaulted to the input
    ids do not, and would count one cross-document target per boundary. Column 0
    is never a target and is left as it is.

    >>> segment_labels(jnp.array([[5, 6, 7, 8]]), jnp.array([[1, 1, 2, 2]])).tolist()
    [[5, 6, -100, 8]]
    """
    labels, seg = jnp.asarray(labels), jnp.asarray(segment_ids)
    start = seg[:, 1:] != seg[:, :-1]  # (B, T-1): column t + 1 opens a segment
    kept = jnp.where(start, jnp.asarray(ignore_index, labels.dtype), labels[:, 1:])
    return jnp.concatenate([labels[:, :1], kept], axis=1)  # (B, T)


def _w(transposed: bool) -> str:
    """The head's einsum axes: ``W (V, D)``, or ``Wᵀ (D, V)`` when ``transposed``."""
    return "iv" if transposed else "vi"


def _head_logits(
    xc: jax.Array, w: jax.Array, matmul_dtype: str | None, f: Any, transposed: bool
) -> jax.Array:
    """One chunk's logits ``(chunk, V)`` in ``f``; ``w`` already in the matmul dtype."""
    spec = f"ci,{_w(transposed)}->cv"
    if matmul_dtype is None:  # bfloat16 inputs: float32 products, never rounded back
        return jnp.einsum(spec, xc, w.astype(xc.dtype), preferred_element_type=f)
    return jnp.einsum(
        spec, xc.astype(w.dtype), w, preferred_element_type=jnp.float32
    ).astype(f)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_nll(
    x: jax.Array,
    w: jax.Array,
    y: jax.Array,
    matmul_dtype: str | None,
    f: Any,
    transposed: bool = False,
) -> jax.Array:
    """``logsumexp(z) - z[y]`` per token, ``z = x Wᵀ`` chunk by chunk: ``(C, chunk)``.

    With ``dz = (softmax(z) - onehot(y)) ⊙ g`` (one elementwise pass, no scatter),
    ``dx = dz W`` and ``dW = dzᵀ x``. Two ways to differentiate:

    - ``W`` frozen (a LoRA step): ``dx = g ⊙ ((softmax(z) - onehot(y)) W)`` and the
      product does not depend on ``g``, so the forward pass computes it while each
      chunk's logits exist, keeps it ``(C, chunk, D)`` (the size of ``x``) and the
      backward pass only scales it: no logits are formed twice ("gradient in the
      forward pass", as fused linear cross-entropy kernels do).
    - ``W`` differentiated: the forward pass keeps ``x`` and the per-token
      ``logsumexp``; the backward pass recomputes each chunk's logits and
      accumulates ``dW`` in float32.

    ``W`` is cast to the matmul dtype once, not once per chunk; ``transposed``: it is
    given as ``Wᵀ (D, V)`` (`entrenar.nn.TiedEmbedding`'s head).
    """
    return _chunked_nll_fwd_impl(x, w, y, matmul_dtype, f, transposed)[0]


def _chunked_nll_fwd_impl(
    x: jax.Array,
    w: jax.Array,
    y: jax.Array,
    matmul_dtype: str | None,
    f: Any,
    transposed: bool,
    with_dx: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-token NLL and ``logsumexp``, each ``(C, chunk)``.

    With ``with_dx``, ``(softmax(z) - onehot(y)) W`` ``(C, chunk, D)`` replaces the
    ``logsumexp``.
    """
    wl = w if matmul_dtype is None else w.astype(matmul_dtype)  # cast once
    md = x.dtype if matmul_dtype is None else wl.dtype

    def one(xy: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        xc, yc = xy
        z = _head_logits(xc, wl, matmul_dtype, f, transposed)  # (chunk, V)
        if not with_dx:
            return nll_and_lse(z, yc)  # (chunk,) each
        nll, _, dz = softmax_xent(z, yc, md)  # dz: (chunk, V), one pass (native)
        dx = jnp.einsum(f"cv,{_w(transposed)}->ci", dz, wl, preferred_element_type=f)
        return nll, dx

    return jax.lax.map(one, (x, y))


def _chunked_nll_fwd(
    x: Any, w: Any, y: Any, matmul_dtype: str | None, f: Any, transposed: bool
) -> tuple[jax.Array, Any]:
    args = (x.value, w.value, y.value, matmul_dtype, f, transposed)
    if x.perturbed and not w.perturbed:  # W frozen: dx now, while z exists
        nll, dx = _chunked_nll_fwd_impl(*args, with_dx=True)
        return nll, (dx, None)
    nll, lse = _chunked_nll_fwd_impl(*args)
    want_dw = jnp.zeros((0,)) if w.perturbed else None
    return nll, (None, (x.value, w.value, y.value, lse, want_dw))


def _chunked_nll_bwd(
    matmul_dtype: str | None, f: Any, transposed: bool, res: Any, g: jax.Array
) -> Any:
    dx, recompute = res
    if recompute is None:  # dx = g ⊙ ((softmax - onehot) W), from the forward pass
        y_ct = np.zeros(dx.shape[:2], jax.dtypes.float0)
        return (dx * g[..., None].astype(f)).astype(dx.dtype), None, y_ct
    x, w, y, lse, want_dw = recompute
    wl = w if matmul_dtype is None else w.astype(matmul_dtype)
    md = x.dtype if matmul_dtype is None else wl.dtype

    def one(dw: Any, xs: tuple[jax.Array, ...]) -> tuple[Any, jax.Array]:
        xc, yc, lc, gc = xs
        z = _head_logits(xc, wl, matmul_dtype, f, transposed)  # (chunk, V)
        dz = softmax_minus_onehot(z, lc, yc) * gc[:, None].astype(f)
        dzl = dz.astype(md)
        ws = _w(transposed)
        dx = jnp.einsum(f"cv,{ws}->ci", dzl, wl, preferred_element_type=f)  # (chunk, D)
        if dw is not None:
            dw = dw + jnp.einsum(
                f"cv,ci->{ws}", dzl, xc.astype(md), preferred_element_type=jnp.float32
            )
        return dw, dx.astype(x.dtype)

    dw0 = None if want_dw is None else jnp.zeros(w.shape, jnp.float32)
    dw, dx = jax.lax.scan(one, dw0, (x, y, lse, g))  # dx: (C, chunk, D)
    y_ct = np.zeros(y.shape, jax.dtypes.float0)
    return dx, (None if dw is None else dw.astype(w.dtype)), y_ct


_chunked_nll.defvjp(_chunked_nll_fwd, _chunked_nll_bwd, symbolic_zeros=True)


@functools.singledispatch
def head_nll(
    weight: Any, x: jax.Array, y: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``logsumexp(x Wᵀ) - (x Wᵀ)[y]`` per token, ``x: (N, D)``, ``y: (N,)``: ``(N,)``.

    A weight node registers a rule (``@head_nll.register(NodeType)``) when it has a
    better way than `chunked_causal_lm_loss`'s chunks of tokens, e.g. a GGUF head
    decoded once for all tokens (`entrenar.quant.ggml_head`); without one the loss
    takes its chunks (this default is never called).
    """
    raise NotImplementedError(f"no head_nll rule for {type(weight).__name__}")


def chunked_causal_lm_loss(
    hidden: jax.Array,
    weight: Any,
    labels: jax.Array,
    reduction: Reduction = "mean",
    *,
    ignore_index: int = IGNORE_INDEX,
    loss_mask: jax.Array | None = None,
    chunk: int = 128,
    matmul_dtype: str | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """`causal_lm_loss` of the logits ``hidden Wᵀ``, never forming them whole.

    The ``N = B (T - 1)`` predicting positions are split into chunks of ``chunk``
    tokens; each chunk's logits ``(chunk, V)`` are formed, reduced to
    ``logsumexp(z) - z[label]`` and dropped, and the backward pass recomputes them
    chunk by chunk (`jax.checkpoint`), so at most one chunk's logits exist at a time
    instead of ``(B, T, V)`` float32 (100 MB for SmolLM2 at 4 x 128 tokens). Equal
    to ``causal_lm_loss(linear(hidden, weight), labels, ...)`` up to float rounding.

    Args:
        hidden: ``(B, T, D)`` final hidden states (`entrenar.nn.Llama.features`).
        weight: the head ``(V, D)``, an array or weight node (`entrenar.nn.linear`).
        labels: integer ``(B, T)`` aligned with the inputs (shifted inside).
        reduction: "mean" over counted tokens, "sum", or "none" (``(B, T - 1)``).
        ignore_index: label value to skip.
        loss_mask: optional bool ``(B, T)``, aligned with the labels.
        chunk: the most tokens per chunk (at least 1); the ``ceil(N / chunk)``
            chunks are balanced to ``ceil(N / chunks)`` tokens each.
        matmul_dtype: passed to `entrenar.nn.linear` (mixed precision).
        softcap: the logits are ``c tanh(z / c)`` with ``c = softcap`` (Gemma 2's
            ``final_logit_softcapping``); None: ``z`` as they are.

    >>> import jax.numpy as jnp
    >>> h, w = jnp.zeros((1, 3, 2)), jnp.ones((4, 2))
    >>> round(float(chunked_causal_lm_loss(h, w, jnp.array([[0, 1, 2]]), chunk=1)), 4)
    1.3863
    """
    hidden = jnp.asarray(hidden)
    labels = jnp.asarray(labels)
    if hidden.ndim != 3 or tuple(labels.shape) != tuple(hidden.shape[:2]):
        raise ShapeError(
            f"chunked_causal_lm_loss needs hidden (B, T, D) and labels (B, T); got "
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)}"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ShapeError(f"labels must be integers, got dtype {labels.dtype}")
    if chunk < 1:
        raise ConfigError(f"chunk must be >= 1, got {chunk}")
    b, t, d = hidden.shape
    n = b * (t - 1)
    x = hidden[:, :-1].reshape(n, d)  # (N, D)
    y = labels[:, 1:].reshape(n)  # (N,)
    valid = y != ignore_index  # (N,)
    if loss_mask is not None:
        valid = valid & jnp.asarray(loss_mask, bool)[:, 1:].reshape(n)
    chunks = max(1, -(-n // chunk))
    chunk = -(-n // chunks)  # balanced: the last chunk is not mostly padding
    pad = chunks * chunk - n
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(chunks, chunk, d)  # (C, chunk, D)
    y = jnp.pad(jnp.where(valid, y, 0), (0, pad)).reshape(chunks, chunk)
    f = jnp.float64 if hidden.dtype == jnp.float64 else jnp.float32
    transposed = False
    if isinstance(weight, Bfloat16Weight):
        weight = weight.value()  # (V, D) bfloat16, never differentiated
    elif isinstance(weight, TiedEmbedding):  # the rounded head (D, V), or the table
        transposed = matmul_dtype is not None and softcap is None
        transposed = transposed and weight.transposed  # (else the table, (V, D))
        weight = weight.head_value() if transposed else weight.table
    if softcap is None and isinstance(weight, jax.Array | np.ndarray):
        w = jnp.asarray(weight)
        nll = _chunked_nll(x, w, y, matmul_dtype, np.dtype(f), transposed)
        nll = nll.reshape(-1)[:n].reshape(b, t - 1)  # (B, T-1)
        return reduce_loss(nll, reduction, where=valid.reshape(b, t - 1))

    own_rule = head_nll.dispatch(type(weight)) is not head_nll.dispatch(object)
    if softcap is None and own_rule:  # a node's own rule: all tokens at once
        nll = head_nll(weight, x.reshape(-1, d), y.reshape(-1), matmul_dtype)
        nll = nll[:n].reshape(b, t - 1)  # (B, T-1)
        return reduce_loss(nll, reduction, where=valid.reshape(b, t - 1))

    @jax.checkpoint
    def one(xy: tuple[jax.Array, jax.Array]) -> jax.Array:
        xc, yc = xy
        z = linear(xc, weight, matmul_dtype=matmul_dtype).astype(f)  # (chunk, V)
        if softcap is not None:
            z = softcap * jnp.tanh(z / softcap)
        lse = jax.nn.logsumexp(z, axis=-1)  # (chunk,)
        return lse - jnp.take_along_axis(z, yc[:, None], axis=-1)[:, 0]

    nll = jax.lax.map(one, (x, y)).reshape(-1)[:n].reshape(b, t - 1)  # (B, T-1)
    return reduce_loss(nll, reduction, where=valid.reshape(b, t - 1))


# ---- distributions ---------------------------------------------------------------
def kl_divergence(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    temperature: float = 1.0,
    reduction: Reduction = "mean",
    *,
    where: jax.Array | None = None,
) -> jax.Array:
    """``KL(softmax(teacher/T) ‖ softmax(student/T))`` summed over the class axis.

    ``Σ_c p_c (log p_c - log q_c)`` with ``p`` the teacher's and ``q`` the student's
    tempered distributions; 0 where they agree, and ``p_c = 0`` terms contribute 0.
    Reduced over the leading axes (``where``: bool over ``logits.shape[:-1]``).
    Distillation multiplies it by ``T²`` (Hinton et al., 2015) so gradients keep
    their scale across temperatures; that factor belongs to the caller.

    >>> float(kl_divergence(jnp.array([[1.0, 2.0]]), jnp.array([[1.0, 2.0]])))
    0.0
    """
    if tuple(jnp.shape(student_logits)) != tuple(jnp.shape(teacher_logits)):
        raise ShapeError(
            f"student logits {tuple(jnp.shape(student_logits))} and teacher logits "
            f"{tuple(jnp.shape(teacher_logits))} must have the same shape"
        )
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    s, t = _float(student_logits), _float(teacher_logits)
    inv_t = jnp.asarray(1.0 / temperature, s.dtype)
    log_q = jax.nn.log_softmax(s * inv_t, axis=-1)  # (..., C)
    log_p = jax.nn.log_softmax(t * inv_t, axis=-1)
    p = jnp.exp(log_p)
    values = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)  # (...)
    return reduce_loss(values, reduction, where=where)


LOSSES: dict[str, Any] = {
    "mse": mse,
    "l1": l1,
    "huber": huber,
    "cross_entropy": cross_entropy,
    "causal_lm": causal_lm_loss,
    "binary_cross_entropy_with_logits": binary_cross_entropy_with_logits,
    "kl_divergence": kl_divergence,
}
"""Losses by the names configs use."""

__all__ = [
    "IGNORE_INDEX",
    "LOSSES",
    "Reduction",
    "binary_cross_entropy_with_logits",
    "causal_lm_loss",
    "check_reduction",
    "chunked_causal_lm_loss",
    "cross_entropy",
    "head_nll",
    "huber",
    "kl_divergence",
    "l1",
    "mse",
    "reduce_loss",
    "segment_labels",
]
