"""The exceptions entrenar raises.

Every error a user can cause is one of these types, and its message says what was wrong
(the file, key, field or shape) and what to do about it. They all derive from
`EntrenarError`, so ``except entrenar.errors.EntrenarError`` catches them all; each also
derives from the built-in exception a Python user would expect (``ValueError``,
``KeyError``, ``RuntimeError``), so existing handlers keep working.
"""

from __future__ import annotations


class EntrenarError(Exception):
    """Base class of every error raised by entrenar."""


class ShapeError(EntrenarError, ValueError):
    """Arrays or tensors whose shapes do not fit the operation."""


class DTypeError(EntrenarError, TypeError):
    """An array of a dtype the operation does not accept."""


class ConfigError(EntrenarError, ValueError):
    """An invalid configuration value or an unknown configuration key."""


class TapeError(EntrenarError, RuntimeError):
    """Misuse of the autograd tape.

    Examples: ``backward`` on a non-scalar without a seed gradient, or changing the data
    of a tensor that requires grad while an operation on the tape still needs it.
    """


class GradientCheckError(EntrenarError, AssertionError):
    """Analytic and finite-difference gradients disagree beyond the threshold."""


class QuantizationError(EntrenarError, ValueError):
    """Values that cannot be quantized (NaN or Inf) or an unsupported scheme."""


class FormatError(EntrenarError, ValueError):
    """A file that is truncated, corrupt, hostile or not in the expected format.

    The message names the file and the field that failed validation.
    """


class TemplateError(EntrenarError, ValueError):
    """A chat template that does not render: invalid, failing, or over its budget.

    The message says which (a syntax error and its line, the template's own error,
    or the limit it exceeded: output size, ``range`` length, render time).
    """


class UnsupportedError(EntrenarError, NotImplementedError):
    """A valid request for something entrenar does not support (yet)."""


class CompatibilityError(EntrenarError, ValueError):
    """Two objects that must match do not (an adapter and its base model, ...)."""


class NonFiniteError(EntrenarError, FloatingPointError):
    """A training step produced a non-finite loss or gradient.

    The message names the step and the quantity; the run's last checkpoint is the
    last good state.
    """


class CheckpointError(EntrenarError, RuntimeError):
    """A checkpoint that cannot be written or restored.

    Writing: the disk is full or read-only (the message says which folder; orbax's
    temporary folder has been removed). Restoring: the checkpoint on disk is corrupt
    or incomplete (``corrupt`` is True; the message names its step and the newest
    good one), which the command line reports as bad input (exit 2).
    """

    def __init__(self, message: str, *, corrupt: bool = False) -> None:
        super().__init__(message)
        self.corrupt = corrupt

    def __reduce__(self) -> tuple[object, ...]:
        return (_checkpoint_error, (str(self), self.corrupt))


def _checkpoint_error(message: str, corrupt: bool) -> CheckpointError:
    return CheckpointError(message, corrupt=corrupt)


__all__ = [
    "CheckpointError",
    "CompatibilityError",
    "ConfigError",
    "DTypeError",
    "EntrenarError",
    "FormatError",
    "GradientCheckError",
    "NonFiniteError",
    "QuantizationError",
    "ShapeError",
    "TapeError",
    "TemplateError",
    "UnsupportedError",
]
