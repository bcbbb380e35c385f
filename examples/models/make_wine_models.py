"""Train the small wine models the distillation and merge configs start from.

``wine-mlp.safetensors``: `examples/configs/wine-mlp.yaml` as shipped (the teacher of
``wine-distill.yaml`` and the base of ``wine-merge.yaml``). ``wine-mlp-ft-a`` and
``-ft-b``: that model trained further for 3 epochs with other seeds and learning
rates (two fine-tunes of one base, what task-vector merges combine). Each file holds
the model's architecture and feature normalisation in its metadata.
Run: ``python examples/models/make_wine_models.py`` (about a minute on a laptop).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from entrenar.runs import train_from_yaml

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "configs", "wine-mlp.yaml")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = train_from_yaml(
            CONFIG, {"training.output_dir": os.path.join(tmp, "base")}, progress=False
        )
        target = os.path.join(HERE, "wine-mlp.safetensors")
        shutil.copyfile(base.files["safetensors"], target)
        print(f"wine-mlp.safetensors: {base.metrics}")
        for tag, seed, lr in (("a", 1, 0.003), ("b", 2, 0.001)):
            run = train_from_yaml(
                CONFIG,
                {
                    "model.architecture": None,
                    "model.config": None,
                    "model.path": target,
                    "scheduler": None,
                    "optimizer.lr": lr,
                    "training.epochs": 3,
                    "training.seed": seed,
                    "training.early_stopping": None,
                    "training.output_dir": os.path.join(tmp, tag),
                },
                progress=False,
            )
            name = f"wine-mlp-ft-{tag}.safetensors"
            shutil.copyfile(run.files["safetensors"], os.path.join(HERE, name))
            print(f"{name}: {run.metrics}")


if __name__ == "__main__":
    main()
