"""metrics.jsonl on resume (a line cut short by a crash) and links in the output."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.errors import ConfigError, FormatError
from entrenar.optim import sgd
from entrenar.train import TrainConfig, Trainer, plot

X = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
DATA = {"x": X, "y": X @ np.array([[1.0], [-2.0], [0.5]], np.float32)}


def loss(p, b, *, key):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def run(out, steps, resume=None):
    cfg = TrainConfig(max_steps=steps, batch_size=4, checkpoint_every=2, log_every=1,
                      output_dir=str(out), progress=False)  # fmt: skip
    return Trainer(loss, {"w": jnp.zeros((3, 1))}, sgd(0.1), cfg).fit(
        DATA, resume=resume
    )


def steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_line_cut_short_by_a_crash_is_dropped_on_resume(tmp_path):
    run(tmp_path, 4)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 5, "epoch": 2, "lo')  # killed while writing step 5
    assert run(tmp_path, 6, resume="latest").steps == 6
    assert steps(metrics) == [1, 2, 3, 4, 5, 6]


def test_a_bad_line_before_the_last_is_named(tmp_path):
    run(tmp_path, 4)
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join([lines[0], "[1, 2]\n", *lines[1:]]))
    with pytest.raises(FormatError, match=r"metrics.jsonl line 2: not a metrics"):
        run(tmp_path, 6, resume="latest")


def test_links_in_the_output_folder_are_not_followed(tmp_path):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere.txt"
    out.mkdir()
    elsewhere.write_text("keep\n")
    (out / "metrics.jsonl").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=r"metrics.jsonl is a symbolic link"):
        run(out, 2)
    assert elsewhere.read_text() == "keep\n"
    (out / "metrics.jsonl").unlink()
    run(out, 2)
    (out / "loss.png").symlink_to(elsewhere)
    plot(out)  # a file written whole replaces the link
    assert elsewhere.read_text() == "keep\n"
    assert not (out / "loss.png").is_symlink()
