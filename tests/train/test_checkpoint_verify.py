"""Checkpoints are verified on restore; failed writes are one clear error."""

import errno
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from entrenar.cli.app import EXIT_FAILED, EXIT_USAGE, exit_code
from entrenar.errors import CheckpointError
from entrenar.optim import sgd
from entrenar.train import Checkpointer, TrainConfig, Trainer, TrainState
from entrenar.train.verify import CHECKSUMS

X = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
DATA = {"x": X, "y": X @ np.array([[1.0], [-2.0], [0.5]], np.float32)}
PARAMS = {"w": jnp.zeros((3, 1))}


def loss(p, b, *, key):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def run(out, steps=4, resume=None):
    """Steps 2 and 4 checkpointed; log_every > steps keeps steps in ``window``."""
    cfg = TrainConfig(max_steps=steps, batch_size=4, checkpoint_every=2,
                      log_every=100, output_dir=str(out), progress=False)  # fmt: skip
    return Trainer(loss, PARAMS, sgd(0.1), cfg).fit(DATA, resume=resume)


def flip_a_bit(folder):
    """Flip one bit in the middle of the largest orbax data file under ``folder``."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(folder / "state") for f in fs]
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    return os.path.relpath(path, folder)


@pytest.fixture
def saved(tmp_path):
    run(tmp_path)
    return tmp_path


def test_checksums_are_written_and_an_intact_checkpoint_resumes(saved):
    sums = json.loads((saved / "checkpoints" / "4" / CHECKSUMS).read_text())["sha256"]
    assert "meta/metadata" in sums and any(k.startswith("state/") for k in sums)
    assert run(saved, steps=6, resume="latest").steps == 6


def test_a_flipped_bit_is_refused_naming_the_step_and_the_good_one(saved):
    flipped = flip_a_bit(saved / "checkpoints" / "4")
    for resume in ("latest", saved / "checkpoints" / "4"):
        with pytest.raises(CheckpointError) as e:
            run(saved, steps=6, resume=resume)
        msg = str(e.value)
        assert "checkpoint step 4" in msg and flipped in msg
        assert "newest intact one is step 2" in msg and "\n" not in msg
        assert e.value.corrupt and exit_code(e.value) == EXIT_USAGE
    flip_a_bit(saved / "checkpoints" / "2")
    with pytest.raises(CheckpointError, match="no older checkpoint is intact"):
        run(saved, steps=6, resume="latest")


def test_missing_or_damaged_metadata_is_a_checkpoint_error(saved):
    step2, step4 = (saved / "checkpoints" / s for s in ("2", "4"))
    meta = json.loads((step4 / "meta" / "metadata").read_text())
    assert meta["window"]  # checked steps not yet logged
    meta["window"][0]["grad_norm"] = None
    (step4 / "meta" / "metadata").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="meta/metadata does not match"):
        run(saved, steps=6, resume="latest")
    (step4 / CHECKSUMS).unlink()  # unverified (an older entrenar's checkpoint)
    with pytest.raises(CheckpointError, match=r"window\[0\]\.grad_norm is null"):
        run(saved, steps=6, resume="latest")
    (step2 / CHECKSUMS).unlink()
    (step2 / "meta" / "metadata").unlink()
    with pytest.raises(CheckpointError, match=r"step 2 .* meta/metadata is missing"):
        run(saved, steps=6, resume=step2)


def _rewrite_json(path, key, value):
    doc = json.loads(path.read_text())
    doc[key] = value
    path.write_text(json.dumps(doc))


def test_damaged_orbax_metadata_is_a_checkpoint_error(saved):
    """Wrong types in orbax's own JSON files of unverified checkpoints."""
    step2, step4 = (saved / "checkpoints" / s for s in ("2", "4"))
    for step in (step2, step4):
        (step / CHECKSUMS).unlink()  # unverified (an older entrenar's checkpoint)
    _rewrite_json(step4 / "state" / "_METADATA", "tree_metadata", 7)
    with pytest.raises(CheckpointError, match=r"step 4 .* cannot be read") as e:
        run(saved, steps=6, resume="latest")
    assert e.value.corrupt and "AttributeError" in str(e.value)
    _rewrite_json(step2 / "_CHECKPOINT_METADATA", "commit_timestamp_nsecs", "x")
    with pytest.raises(CheckpointError, match="_CHECKPOINT_METADATA is damaged"):
        run(saved, steps=6, resume="latest")


def _state(step):
    state = TrainState.create(PARAMS, sgd(0.1), key=jax.random.key(0))
    return state._replace(step=jnp.asarray(step, state.step.dtype))


def test_a_full_disk_is_one_line_and_leaves_no_temporary_folder(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_state(1), {"n": 1})

    async def full(self, item, directory):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", full)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(_state(2), {"n": 2})
    msg = str(e.value)
    assert "could not write checkpoint step 2" in msg and "No space left" in msg
    assert "newest complete checkpoint is step 1" in msg and "\n" not in msg
    assert not e.value.corrupt and exit_code(e.value) == EXIT_FAILED
    assert sorted(os.listdir(tmp_path)) == ["1"]
    monkeypatch.undo()
    ckpt.save(_state(2), {"n": 2})  # space freed: the same step saves
    assert ckpt.steps() == [1, 2]
    ckpt.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_a_read_only_folder_is_one_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(_state(1), {"n": 1})
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(CheckpointError, match="could not write checkpoint step 2"):
            ckpt.save(_state(2), {"n": 2})
    finally:
        os.chmod(tmp_path, 0o755)
    assert sorted(os.listdir(tmp_path)) == ["1"]
