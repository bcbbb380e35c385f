"""``entrenar merge --quantized``: noisy task vectors corrected (noted) or refused.

Two "fine-tunes" that are only the base re-quantized onto the Q8_0 grid: every bit of
their difference from the Q4_1-grid base is rounding noise.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from click.testing import CliRunner

from entrenar import io
from entrenar.cli import cli
from entrenar.lora.export import stored


def on_grid(x, kind):
    return np.asarray(stored(jnp.asarray(x), kind))


def files(tmp_path):
    w = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32) * 0.05
    w = on_grid(w, "Q4_1")
    out = []
    for name, x in (("base", w), ("a", on_grid(w, "Q8_0")), ("b", on_grid(w, "Q8_0"))):
        path = tmp_path / f"{name}.safetensors"
        io.save_model(io.Model(io.ModelMetadata(name), {"w": x}), path)
        out.append(str(path))
    return out


def test_noise_is_corrected_with_a_note_or_refused(tmp_path):
    base, a, b = files(tmp_path)
    out = str(tmp_path / "m.safetensors")
    args = ["merge", a, b, "--base", base, "--method", "ties", "--density", "0.5",
            "-o", out]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "corrected" in r.output and "Q8_0" in r.output
    assert f"merged 2 models onto base {base} (ties)" in r.output
    np.testing.assert_array_equal(io.load_model(out).params["w"],
                                  io.load_model(base).params["w"])  # fmt: skip
    r = CliRunner().invoke(cli, [*args, "--quantized", "refuse"])
    assert r.exit_code != 0
    assert "adapters" in r.output and "folded float models" in r.output
