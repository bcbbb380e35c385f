"""Test configuration: JAX on the CPU with strict dtype promotion.

Strict promotion makes silent float64/int mixing an error, so dtype bugs fail loudly
(equinox's tests do the same). Hypothesis keeps a small, deterministic budget so the
suite stays fast on a 2-core machine.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "entrenar",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("entrenar")
