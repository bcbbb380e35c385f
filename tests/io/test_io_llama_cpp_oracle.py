"""llama.cpp as a recorded oracle: no test can crash pytest, and the records hold.

`llama_cpp_cases.run_script` runs tests/oracles/make_llama_cpp_reference.py in a
subprocess; these tests force that subprocess to die or to miss llama_cpp and check that
the caller sees a skip with the reason (not a crash), and that other errors fail.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from llama_cpp_cases import (
    RECORDED,
    REFERENCE_JSON,
    REFERENCE_NPZ,
    load_reference,
    run_script,
    seeded_weight,
    tiny_config,
    tiny_params,
)

from entrenar.quant import dequantize, quantize

# The script's test hooks, set here whatever the outer environment says.
DIE = {"ENTRENAR_LLAMA_CPP_DIE": "SEGV", "ENTRENAR_NO_LLAMA_CPP": ""}
NO_LLAMA = {"ENTRENAR_LLAMA_CPP_DIE": "", "ENTRENAR_NO_LLAMA_CPP": "1"}


def test_subprocess_killed_by_a_signal_is_a_skip(tmp_path):
    with pytest.raises(pytest.skip.Exception, match="died from SIGSEGV"):
        run_script(tmp_path, env=DIE)
    with pytest.raises(pytest.skip.Exception, match="died from SIGABRT"):
        run_script(tmp_path, env={**DIE, "ENTRENAR_LLAMA_CPP_DIE": "ABRT"})


def test_missing_llama_cpp_is_a_skip(tmp_path):
    with pytest.raises(pytest.skip.Exception, match="llama_cpp is not importable"):
        run_script(tmp_path, env=NO_LLAMA)


def test_other_script_errors_fail(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="exited with status 2"):
        run_script(tmp_path, "--no-such-option", env=NO_LLAMA)


def test_a_suite_whose_llama_cpp_dies_reports_a_skip_and_goes_on(tmp_path):
    """A whole pytest run: the live comparison skips, the next test still runs."""
    (tmp_path / "test_live.py").write_text(
        textwrap.dedent(
            """
            from llama_cpp_cases import reference

            def test_live():
                reference("live")

            def test_after():
                pass
            """
        )
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    here = str(Path(__file__).parent)
    env = {
        **os.environ,
        **DIE,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
    }
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed, 1 skipped" in p.stdout, p.stdout
    assert "died from SIGSEGV" in p.stdout, p.stdout


def test_recorded_files_are_small_and_say_how_they_were_made():
    sizes = [(RECORDED / f).stat().st_size for f in (REFERENCE_JSON, REFERENCE_NPZ)]
    assert sum(sizes) < 3_000_000
    record, arrays = load_reference(RECORDED)
    how = record["how"]
    assert how["llama_cpp_python"] and "make_llama_cpp_reference.py" in how["command"]
    assert "-DGGML_AMX_INT8=OFF" in how["cmake_args"]
    assert "AMX_INT8 = 1" not in how["system_info"]
    assert all(a.dtype != object for a in arrays.values())
    with open(RECORDED / REFERENCE_JSON, encoding="utf-8") as f:
        assert json.load(f) == record


def test_seeded_weights_are_exact_in_q4_0_and_machine_independent():
    w = seeded_weight("blk.0.attn_q.weight", (3, 64), seed=0)
    k = w * 32
    assert np.array_equal(k, np.round(k)) and k.min() == -8 and k.max() <= 7
    assert ((k.reshape(-1, 32) == -8).sum(-1) == 1).all()  # one -8 per block
    np.testing.assert_array_equal(np.asarray(dequantize(quantize(w, "q4_0"))), w)
    np.testing.assert_array_equal(w.astype(np.float16).astype(np.float32), w)
    # Pinned values: the recorded tiny-model outputs rely on this exact stream.
    assert k[0, :8].tolist() == [4, -8, 0, -3, -6, 1, 1, 7]
    assert not np.array_equal(w, seeded_weight("blk.0.attn_k.weight", (3, 64), 0))
    assert not np.array_equal(w, seeded_weight("blk.0.attn_q.weight", (3, 64), 1))
    params = tiny_params(tiny_config())
    assert params["model"]["embed_tokens"]["weight"].shape == (49152, 64)
