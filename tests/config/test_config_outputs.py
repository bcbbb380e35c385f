"""What a run leaves in its output folder: file modes, the folder lock, resuming."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from config_cases import wine_doc, write

REPO = Path(__file__).parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

UMASK_RUNS = """
import os, sys
from entrenar.config import train_from_yaml
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
