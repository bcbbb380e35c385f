"""What a run leaves in its output folder: file modes, the folder lock, resuming."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from config_cases import wine_doc, write

from entrenar import io, merge
from entrenar.config.summary import validate
from entrenar.errors import ConfigError
from entrenar.optim import sgd
from entrenar.runs import train_from_yaml
from entrenar.runs.export import write_outputs
from entrenar.runs.quantize import quantize_file
from entrenar.runs.run import prepare
from entrenar.train import TrainConfig, Trainer

REPO = Path(__file__).parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

UMASK_RUNS = """
import os, sys
from entrenar.runs import train_from_yaml
from entrenar.io import atomic_write
for mask, config in zip((0o022, 0o077), sys.argv[1:]):
    os.umask(mask)
    result = train_from_yaml(config, progress=False)
    with atomic_write(os.path.join(result.output_dir, "extra.bin")) as f:
        f.write(b"x")
"""


def _modes(folder: Path) -> dict[str, int]:
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def test_files_and_folders_get_the_modes_the_umask_allows(tmp_path):
    configs = [
        write(tmp_path / f"{m}.yaml", wine_doc(tmp_path / m)) for m in ("022", "077")
    ]
    subprocess.run(
        [sys.executable, "-c", UMASK_RUNS, *map(str, configs)],
        check=True, cwd=REPO, env=ENV, capture_output=True, timeout=600,
    )  # fmt: skip
    for mask in (0o022, 0o077):
        folder = tmp_path / f"{mask:03o}"
        modes = _modes(folder)
        written = {"config.json", "result.json", "model.safetensors", "extra.bin"}
        assert written | {"metrics.jsonl", "checkpoints/6/meta/metadata"} <= set(modes)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask
        for name, mode in modes.items():
            want = 0o777 if (folder / name).is_dir() else 0o666
            assert mode == want & ~mask, (name, oct(mode), oct(mask))
        assert not [n for n in modes if ".tmp-" in n or n.endswith(".lock")]
        assert json.loads((folder / "result.json").read_text())["metrics"]["steps"]


def _linear(p, b, *, key):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def test_every_workflow_refuses_an_output_another_process_writes(tmp_path, hold_locks):
    model = tmp_path / "m.safetensors"
    leaves = {"w": np.ones((4, 64), np.float32)}
    io.save_model(io.Model(io.ModelMetadata("m", "mlp"), leaves), str(model))
    trainer_dir, run_dir, export_dir = (tmp_path / n for n in ("t", "run", "ex"))
    stale = trainer_dir / "checkpoints" / "3.orbax-checkpoint-tmp-1"
    stale.mkdir(parents=True)  # a checkpoint being written by the holder
    held = [f"{trainer_dir}/", f"{run_dir}/", f"{export_dir}/",
            tmp_path / "q.safetensors", tmp_path / "merged.safetensors"]  # fmt: skip
    proc = hold_locks(*held)
    holder = f"pid {proc.pid} on host {socket.gethostname()}"
    config = write(tmp_path / "run.yaml", wine_doc(run_dir))
    try:
        cfg = TrainConfig(max_steps=2, batch_size=2, output_dir=str(trainer_dir),
                          progress=False)  # fmt: skip
        data = {"x": np.ones((4, 4), np.float32), "y": np.ones((4, 1), np.float32)}
        runs = {
            trainer_dir: lambda: Trainer(
                _linear, {"w": jnp.zeros((4, 1))}, sgd(0.1), cfg
            ).fit(data, resume="latest"),
            run_dir: lambda: train_from_yaml(config, progress=False),
            export_dir: lambda: write_outputs(
                spec, prep.built, prep.params, str(export_dir)
            ),
            tmp_path / "q.safetensors": lambda: quantize_file(
                str(model), str(tmp_path / "q.safetensors"), "int8"
            ),
            tmp_path / "merged.safetensors": lambda: merge.merge_files(
                [model, model], "linear", tmp_path / "merged.safetensors"
            ),
        }
        spec = validate(config)
        prep = prepare(spec)
        for target, run in runs.items():
            with pytest.raises(ConfigError) as e:
                run()
            assert str(target) in str(e.value) and holder in str(e.value)
    finally:
        proc.stdin.close()
        proc.wait()
    assert stale.exists()  # the holder's checkpoint in progress is left alone
    assert not (trainer_dir / "metrics.jsonl").exists()
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", "run.yaml", "t"]
