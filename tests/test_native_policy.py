"""The kernel policy (entrenar/native/__init__.py): one decision for every call site.

The table of reasons, each call site's custom call present or absent in its lowered
computation by policy, the YAML key ``model.kernels`` and ``entrenar info``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml
from click.testing import CliRunner

from entrenar import native, optim, quant
from entrenar.cli import cli
from entrenar.errors import ConfigError, UnsupportedError
from entrenar.nn.attention import dot_product_attention
from entrenar.nn.softmax_xent import softmax_xent
from entrenar.quant.linear import quantized_matmul
from entrenar.runs import train_from_yaml

ROOT = Path(__file__).parents[1]
F32 = jax.ShapeDtypeStruct((4,), jnp.float32)


@pytest.fixture
def one_device(monkeypatch):
    """A process that passes every check but the one a test changes."""
    monkeypatch.delenv("ENTRENAR_NATIVE", raising=False)
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)


# --- the table -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"policy": "jax"}, "policy jax"),
        ({"env": "0"}, "ENTRENAR_NATIVE=0"),
        ({"env": "no"}, "ENTRENAR_NATIVE=no"),
        ({"backend": "gpu"}, "backend gpu"),
        ({"devices": 8}, "8 devices (a kernel would gather sharded operands)"),
        ({"policy": "jax", "env": "0", "devices": 8}, "policy jax"),  # in order
        ({"env": "0", "backend": "gpu"}, "ENTRENAR_NATIVE=0"),
        ({"backend": "gpu", "devices": 8}, "backend gpu"),
    ],
)
def test_each_reason_turns_every_kernel_off(monkeypatch, one_device, change, why):
    if "env" in change:
        monkeypatch.setenv("ENTRENAR_NATIVE", change["env"])
    if "backend" in change:
        monkeypatch.setattr(jax, "default_backend", lambda: change["backend"])
    if "devices" in change:
        monkeypatch.setattr(jax, "device_count", lambda *a: change["devices"])
    with native.policy(change.get("policy", "auto")):
        for name in native.KERNELS:
            assert native.reason(name) == why
        assert not native.use("adamw", F32, F32, F32, F32)


def test_dtypes_are_checked_per_operand_and_never_an_error(one_device):
    with native.policy("native"):  # other dtypes take the JAX path, even here
        assert not native.use("adamw", F32, F32, F32, jnp.bfloat16)
        assert not native.use("attention", F32, F32, F32, "float16")
        assert not native.use("softmax_xent", F32, jnp.float32, jnp.bfloat16)
        assert not native.use("softmax_xent", F32, jnp.int8, jnp.float32)
        assert not native.use("nf4_matmul", jnp.bfloat16)
        assert not native.use("nf4_dequantize", jnp.float16)


@pytest.mark.skipif(native.reason("adamw") is not None, reason="no kernels here")
def test_operands_of_the_kernels_dtypes_run_it():
    assert native.use("adamw", F32, F32, F32, F32)
    assert native.use("attention", F32, F32, F32, "bfloat16")
    assert native.use("softmax_xent", F32, jnp.uint16, jnp.bfloat16)
    assert native.use("nf4_dequantize", jnp.bfloat16)


def test_policy_native_refuses_what_cannot_run(monkeypatch, one_device):
    monkeypatch.setattr(jax, "device_count", lambda *a: 4)
    native.check()  # auto: nothing to check
    with native.policy("native"):
        with pytest.raises(UnsupportedError, match=r"'adamw' kernel .* 4 devices"):
            native.use("adamw", F32, F32, F32, F32)
        with pytest.raises(UnsupportedError, match=r"model\.kernels: auto"):
            native.check()
    assert native.current_policy() == "auto"


def test_policy_values_and_programming_errors():
    with pytest.raises(ConfigError, match=r"'fast'.*auto, native, jax"):
        native.set_policy("fast")
    with pytest.raises(KeyError, match="unknown native kernel"):
        native.use("matmul", F32)
    with pytest.raises(TypeError, match="takes 4 operands, got 1"):
        native.use("adamw", F32)
    assert native.POLICIES == ("auto", "native", "jax")


NO_COMPILER = """
    import warnings
    warnings.simplefilter("ignore")
    from entrenar import native
    from entrenar.errors import UnsupportedError
    print([native.reason(k) for k in native.KERNELS])
    native.set_policy("native")
    for step in (native.check, lambda: native.use("nf4_dequantize", "float32")):
        try:
            step()
        except UnsupportedError as e:
            print(type(e).__name__, e)
"""


def _python(code: str, tmp_path: Path, **env: str) -> list[str]:
    full = {**os.environ, "ENTRENAR_CACHE_DIR": str(tmp_path / "cache"), **env}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_no_compiler_is_the_reason_and_refused_under_native(tmp_path):
    (tmp_path / "bin").mkdir()
    lines = _python(NO_COMPILER, tmp_path, CXX="", PATH=str(tmp_path / "bin"))
    assert lines[0] == str(["no C++ compiler found (set CXX)"] * len(native.KERNELS))
    assert lines[1].startswith("UnsupportedError kernel policy 'native'")
    assert lines[1].endswith("set model.kernels: auto to take the pure-JAX path "
                             "where a kernel is off")  # fmt: skip
    assert "the native 'nf4_dequantize' kernel cannot run here: no C++" in lines[2]


def test_a_failing_build_is_one_short_reason(tmp_path):
    fake = tmp_path / "fake-c++"
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = "--version" ]; then echo fake; exit 0; fi\n'
        "echo 'error: nope' >&2; exit 1\n"
    )
    fake.chmod(0o755)
    code = "from entrenar import native; print(native.reason('adamw'))"
    lines = _python(code, tmp_path, CXX=str(fake))
    assert lines == ["build failed: the compiler failed"]


# --- every call site asks native.use ------------------------------------------------


def _nf4():
    w = jnp.linspace(-1.0, 1.0, 64 * 128).reshape(64, 128)
    return quant.quantize(w, "nf4")


def _adamw_step():
    tx = optim.adamw(0.01)
    p = {"w": jnp.ones((8,))}
    return lambda: optim.apply_gradients(tx, p, tx.init(p), p)


def _adamw8bit_step():
    tx = optim.adamw_8bit(0.01)
    p = {"w": jnp.ones((16, 256))}
    return lambda: optim.apply_gradients(tx, p, tx.init(p), p)


SITES = {  # kernel: (its custom-call target, a function that should call it)
    "attention": (
        "entrenar_attention_fwd",
        lambda: dot_product_attention(*(jnp.ones((1, 4, 2, 8)),) * 3, None),
    ),
    "softmax_xent": (
        "entrenar_softmax_xent",
        lambda: softmax_xent(
            jnp.ones((4, 16)), jnp.zeros((4,), jnp.int32), jnp.bfloat16
        ),
    ),
    "adamw": ("entrenar_adamw", _adamw_step()),
    "adamw8bit": ("entrenar_adamw8bit", _adamw8bit_step()),
    "nf4_matmul": (
        "entrenar_nf4_matmul",
        lambda: quantized_matmul(_nf4(), jnp.ones((2, 128))),
    ),
    "nf4_dequantize": (
        "entrenar_nf4_dequantize_f32",
        lambda: quant.dequantize(_nf4(), jnp.float32),
    ),
    "nf4_quantize": (
        "entrenar_nf4_quantize_f32",
        lambda: quant.quantize(jnp.ones((4, 64)), "nf4"),
    ),
    "ggml_matvec": (
        "entrenar_q_matvec",
        lambda: quantized_matmul(
            quant.quantize(jnp.ones((4, 64)), scheme="q8_0"), jnp.ones((2, 64))
        ),
    ),
}


def _lowered(fn) -> str:
    return jax.jit(fn).lower().as_text()


def test_every_kernel_has_a_site():
    assert set(SITES) == set(native.KERNELS) == set(native.SIGNATURES)


@pytest.mark.parametrize("name", sorted(SITES))
def test_policy_jax_leaves_no_custom_call(name):
    with native.policy("jax"):
        assert "entrenar_" not in _lowered(SITES[name][1])


@pytest.mark.parametrize("name", sorted(SITES))
def test_policy_auto_calls_the_kernel_where_it_builds(name):
    if native.reason(name) is not None:
        pytest.skip(f"the kernel is off here: {native.reason(name)}")
    target, fn = SITES[name]
    assert target in _lowered(fn)


def test_a_policy_change_retraces_functions_already_traced():
    if native.reason("softmax_xent") is not None:
        pytest.skip("the kernel is off here")
    f = jax.jit(SITES["softmax_xent"][1])
    assert "entrenar_softmax_xent" in f.lower().as_text()
    with native.policy("jax"):
        assert "entrenar_" not in f.lower().as_text()
    assert "entrenar_softmax_xent" in f.lower().as_text()


def test_no_module_decides_on_its_own():
    """Whoever emits a custom call asks `native.use`; nobody else calls `load`."""
    for path in sorted((ROOT / "entrenar").rglob("*.py")):
        if path.parent.name == "native":
            continue
        text = path.read_text()
        calls = {
            f"{n.func.value.id}.{n.func.attr}"
            for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
        }
        where = path.relative_to(ROOT)
        assert "native.load" not in calls, where
        assert "load_native" not in text and "native import load" not in text, where
        if "ffi_call(" in text:  # emits a kernel: the policy decides, nothing else
            assert "native.use" in calls, f"{where} emits a kernel without native.use"
            assert "device_count" not in text, where


# --- model.kernels and entrenar info -------------------------------------------------


def _config(tmp_path: Path, kernels: str) -> Path:
    wine = ROOT / "examples" / "data" / "wine"
    doc = {
        "model": {
            "architecture": "mlp",
            "config": {"sizes": [13, 8, 3]},
            "kernels": kernels,
        },
        "data": {"train": str(wine / "train.parquet"), "target": "cultivar"},
        "training": {"max_steps": 2, "output_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_model_kernels_sets_the_policy_for_the_run_only(tmp_path, monkeypatch):
    from entrenar.runs import run

    seen = []
    prepare = run.prepare
    monkeypatch.setattr(
        run,
        "prepare",
        lambda spec: seen.append(native.current_policy()) or prepare(spec),
    )
    train_from_yaml(_config(tmp_path, "jax"), dry_run=True)
    assert seen == ["jax"] and native.current_policy() == "auto"
    with pytest.raises(ConfigError, match=r"model\.kernels: must be one of"):
        train_from_yaml(_config(tmp_path, "fast"), dry_run=True)


def test_model_kernels_native_stops_before_the_model_loads(tmp_path, monkeypatch):
    from entrenar.runs import run

    monkeypatch.setenv("ENTRENAR_NATIVE", "0")
    monkeypatch.setattr(run, "prepare", lambda spec: pytest.fail("model loaded"))
    with pytest.raises(UnsupportedError, match="cannot run here: ENTRENAR_NATIVE=0"):
        train_from_yaml(_config(tmp_path, "native"), dry_run=True)
    assert native.current_policy() == "auto"


def test_info_prints_one_line_per_kernel(monkeypatch):
    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "kernel_policy: auto" in lines and "backend: cpu" in lines
    for name in native.KERNELS:
        why = native.reason(name)
        assert f"  {name}: {'on' if why is None else 'off: ' + why}" in lines
    monkeypatch.setenv("ENTRENAR_NATIVE", "0")
    data = json.loads(CliRunner().invoke(cli, ["info", "--format", "json"]).output)
    assert set(data["kernels"].values()) == {"off: ENTRENAR_NATIVE=0"}


def test_info_of_a_config_shows_its_kernels(tmp_path):
    result = CliRunner().invoke(cli, ["info", str(_config(tmp_path, "jax"))])
    assert result.exit_code == 0, result.output
    assert "  adamw: off: policy jax" in result.output.splitlines()
    assert native.current_policy() == "auto"
