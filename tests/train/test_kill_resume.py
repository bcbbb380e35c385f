"""SIGKILL a run (at random steps, or mid-checkpoint), resume: bit-identical end.

Params, optimizer state, key, history and metrics.jsonl all equal those of an
uninterrupted run.

Each run is a subprocess of tests/train/resumable_run.py.
"""

import importlib.util
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from entrenar.train import Checkpointer

SCRIPT = Path(__file__).with_name("resumable_run.py")
pytestmark = pytest.mark.slow


def load_script():
    spec = importlib.util.spec_from_file_location("resumable_run", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RUN = load_script()


def run(out, *, kill_at=None, hang_at=None):
    """Run the script; SIGKILL it after 'STEP kill_at' or at 'HANG'. Return lines."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if hang_at is not None:
        env["HANG_AT_CHECKPOINT"] = str(hang_at)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out)], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    lines, deadline = [], time.monotonic() + 300
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if lines[-1] in (f"STEP {kill_at}", "HANG"):
                proc.kill()  # SIGKILL: no cleanup, no flush, no atexit
                break
            assert time.monotonic() < deadline, "the training subprocess hung"
    finally:
        proc.kill()
        proc.wait()
    return lines


def final_checkpoint(out):
    ck = Checkpointer(Path(out) / "checkpoints")
    template = RUN.build(None)[0].state
    return ck.restore(template, RUN.MAX_STEPS)


def assert_same_run(a, b):
    (sa, ma), (sb, mb) = final_checkpoint(a), final_checkpoint(b)
    la = jax.tree_util.tree_leaves((sa.trainable, sa.opt_state, sa.step))
    lb = jax.tree_util.tree_leaves((sb.trainable, sb.opt_state, sb.step))
    assert len(la) == len(lb) > 5
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bit for bit
    np.testing.assert_array_equal(
        jax.random.key_data(sa.key), jax.random.key_data(sb.key)
    )

    def strip(history):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in history]

    assert strip(ma["history"]) == strip(mb["history"])
    assert ma["eval_history"] == mb["eval_history"]
    logs = [(Path(d) / "metrics.jsonl").read_text() for d in (a, b)]
    assert logs[0] == logs[1] and logs[0].count("\n") > 5


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert run(out)[-1] == "DONE"
    return out


def test_sigkill_at_random_steps_then_resume_is_bit_identical(uninterrupted, tmp_path):
    rng = random.Random()
    first = rng.randint(2, RUN.MAX_STEPS // 2)
    second = rng.randint(first + 1, RUN.MAX_STEPS - 1)
    out = tmp_path / "killed"
    assert run(out, kill_at=first)[-1] == f"STEP {first}", (first, second)
    resumed = run(out, kill_at=second)  # resumes, then is killed again
    assert resumed[0] != "STEP 1" and resumed[-1] == f"STEP {second}", (first, second)
    assert run(out)[-1] == "DONE"
    assert_same_run(uninterrupted, out)


def test_sigkill_during_checkpoint_write_keeps_previous_one(uninterrupted, tmp_path):
    out = tmp_path / "hung"
    assert run(out, hang_at=5)[-1] == "HANG"
    ckdir = out / "checkpoints"
    assert any(".orbax-checkpoint-tmp" in p for p in os.listdir(ckdir))  # half written
    ck = Checkpointer(ckdir)
    assert ck.latest_step() == 4
    template = RUN.build(None)[0].state
    state, meta = ck.restore(template)
    ref, ref_meta = Checkpointer(uninterrupted / "checkpoints").restore(template, 4)
    got = jax.tree_util.tree_leaves((state.trainable, state.opt_state))
    want = jax.tree_util.tree_leaves((ref.trainable, ref.opt_state))
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    del meta["config"]["output_dir"], ref_meta["config"]["output_dir"]
    assert meta == ref_meta
    assert run(out)[-1] == "DONE"  # and the run still ends as if never killed
    assert_same_run(uninterrupted, out)
