"""The hostile-input corpus through every public loader and the command line (issue 35).

``tests/data/hostile/`` holds small hostile files written by
``tools/make_hostile_corpus.py`` (``MANIFEST.json`` lists the cases). Each case is
fed to the public loaders the manifest names, in a worker process with a memory
limit and a per-case deadline, so a hang or a memory bomb fails its case instead of
stalling the suite. A refusal must be an `entrenar.errors.EntrenarError` whose
message names the file (and the key at fault where the manifest gives one); the
valid controls must load. A few command lines must exit 2 with one ``error:`` line.

Run ``python tests/test_hostile_inputs.py --worker ID ...`` to see what the worker
reports for some cases.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
HOSTILE = REPO / "tests" / "data" / "hostile"
MANIFEST: list[dict[str, Any]] = json.loads(
    (HOSTILE / "MANIFEST.json").read_text(encoding="utf-8")
)
CASE_SECONDS = 8.0
"""Deadline of one case (the slowest valid case takes well under a second)."""
START_SECONDS = 120.0
"""Deadline for a worker to import entrenar and report its first case."""
MEMORY_LIMIT = 4 << 30
"""Address-space limit of the worker: a memory bomb is a MemoryError, not an OOM."""
MESSAGES = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- loaders (worker)
def corpus_script() -> Any:
    """``tools/make_hostile_corpus.py`` as a module (its `CONFIG`, its `build`)."""
    spec = importlib.util.spec_from_file_location(
        "make_hostile_corpus", REPO / "tools" / "make_hostile_corpus.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _base_params() -> Any:
    """Zero weights of the corpus's tiny Llama (what the adapters attach to)."""
    import numpy as np

    def walk(node: Any) -> Any:
        if isinstance(node, tuple):
            return np.zeros(node, np.float32)
        return {k: walk(v) for k, v in node.items()}

    return walk(corpus_script().CONFIG.param_shapes())


def _chat_template(path: str) -> None:
    from entrenar import data

    template = data.load_fast_tokenizer(path).chat_template
    assert template is not None, f"{path} has no chat template"
    data.render_chat(MESSAGES, template)


def _validate(path: str) -> None:
    from entrenar.config import validate
    from entrenar.runs import preflight

    spec = validate(path)
    if not spec.is_merge:
        preflight.preflight(spec)


def _tabular(path: str) -> None:
    from entrenar import data

    data.to_arrays(data.load_records(path), {"x": ["f1", "f2"], "y": "label"})


def _loaders() -> dict[str, Callable[[str], Any]]:
    """Loader name (as in the manifest) -> the public call it stands for."""
    from entrenar import config, data, io, lora, merge
    from entrenar.runs.info import model_info
    from entrenar.runs.models import load_built, read_header

    return {
        "gguf_model": io.load_model,
        "tokenizer": io.load_tokenizer,
        "fast_tokenizer": data.load_fast_tokenizer,
        "chat_template": _chat_template,
        "model": io.load_model,
        "hf_folder": io.load_hf_folder,
        "safetensors": io.read_safetensors,
        "adapter": lambda p: lora.load_adapter(p, _base_params()),
        "config": config.load_config,
        "validate": _validate,
        "info": model_info,
        "built": load_built,
        "header": read_header,
        "recipe": merge.run_recipe,
        "records": data.load_records,
        "tabular": _tabular,
    }


def case_ids() -> list[str]:
    """``"<path>::<loader>"`` for every case and each of its loaders."""
    return [f"{c['path']}::{name}" for c in MANIFEST for name in c["loaders"]]


def _run_one(case_id: str, loaders: dict[str, Callable[[str], Any]]) -> dict:
    from entrenar.errors import EntrenarError

    rel, name = case_id.split("::")
    start = time.monotonic()
    try:
        loaders[name](str(HOSTILE / rel))
        out: dict[str, Any] = {"kind": "ok"}
    except Exception as e:
        out = {
            "kind": "error",
            "type": type(e).__name__,
            "entrenar": isinstance(e, EntrenarError),
            "message": str(e)[:2000],
            "traceback": "".join(traceback.format_exception(e)[-4:])[-1500:],
        }
    return {"id": case_id, "seconds": round(time.monotonic() - start, 3), **out}


def worker(ids: list[str]) -> None:
    """Run cases one by one, reporting ``start`` and the result of each on stdout."""
    loaders = _loaders()
    for case_id in ids:
        print(json.dumps({"event": "start", "id": case_id}), flush=True)
        print(json.dumps({"event": "done", **_run_one(case_id, loaders)}), flush=True)


# ------------------------------------------------------------------ parent (pytest)
def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


class _Lines:
    """Lines of a pipe, each read with a deadline (select on the raw descriptor)."""

    def __init__(self, stream: Any) -> None:
        self.fd, self.buf = stream.fileno(), b""

    def next(self, deadline: float) -> str | None:
        """The next line, or None at end of stream or past ``deadline``."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("utf-8")


def run_cases(ids: list[str]) -> dict[str, dict]:
    """Each case's result; a worker that hangs or dies is replaced for the rest."""
    results: dict[str, dict] = {}
    todo = list(ids)
    while todo:
        stderr = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", *todo],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=_env(),
            preexec_fn=_limit_memory,
        )
        lines, current = _Lines(proc.stdout), None
        deadline = time.monotonic() + START_SECONDS
        while (line := lines.next(deadline)) is not None:
            msg = json.loads(line)
            if msg.pop("event") == "start":
                current = msg["id"]
            else:
                results[msg["id"]], current = msg, None
                todo.remove(msg["id"])
            deadline = time.monotonic() + CASE_SECONDS
        proc.kill()
        proc.wait()
        if current is None and not todo:
            break
        if current is None:  # died between cases (or before the first)
            current = todo[0]
        kind = "hang" if proc.returncode == -9 else f"exit {proc.returncode}"
        stderr.seek(0)
        tail = stderr.read()[-1500:].decode("utf-8", "replace")
        results[current] = {"id": current, "kind": kind, "stderr": tail}
        todo.remove(current)
    return results


def _env() -> dict[str, str]:
    """This checkout first on the path, JAX on the CPU."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return run_cases(case_ids())


def _case(case_id: str) -> dict[str, Any]:
    rel = case_id.split("::")[0]
    return next(c for c in MANIFEST if c["path"] == rel)


@pytest.mark.parametrize("case_id", case_ids())
def test_each_hostile_file_is_an_entrenar_error_naming_the_file(results, case_id):
    case, got = _case(case_id), results[case_id]
    path = str(HOSTILE / case["path"])
    if case["expect"] == "ok":
        assert got["kind"] == "ok", got
        return
    assert got["kind"] == "error", f"{case['why']}: {got}"
    assert got["entrenar"], f"{case['why']}: a plain {got['type']}: {got}"
    if case["names_file"]:
        assert path in got["message"], got["message"]
    assert case["match"] in got["message"], got["message"]


def test_the_corpus_is_what_the_script_writes(tmp_path):
    corpus_script().build(tmp_path / "hostile")

    def files(root: Path) -> dict[str, bytes]:
        return {
            str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    want, got = files(tmp_path / "hostile"), files(HOSTILE)
    assert sorted(got) == sorted(want)
    assert [k for k in want if want[k] != got[k]] == []
    assert sum(map(len, got.values())) < 200_000


CLI = [
    (["validate", "config/alias_bomb.yaml"], "config/alias_bomb.yaml"),
    (["validate", "config/tabular_nan.yaml"], "row 3, column 'f2'"),
    (["info", "gguf/truncated_data.gguf"], "gguf/truncated_data.gguf"),
    (
        ["eval", "gguf/rope_nan.gguf", "--data", "data/invalid_utf8.jsonl"],
        "llama.rope.freq_base",
    ),
]


@pytest.fixture(scope="module")
def cli_runs() -> list[subprocess.CompletedProcess]:
    """The `CLI` command lines, run side by side in subprocesses."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "entrenar", *args],
            cwd=HOSTILE,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_limit_memory,
        )
        for args, _ in CLI
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        out.append(
            subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        )
    return out


@pytest.mark.parametrize("i", range(len(CLI)), ids=[" ".join(a) for a, _ in CLI])
def test_the_command_line_exits_2_with_one_error_line(cli_runs, i):
    run, match = cli_runs[i], CLI[i][1]
    lines = run.stderr.strip().splitlines()  # progress lines may come first
    assert run.returncode == 2, run.stderr
    assert [x for x in lines if x.startswith("error: ")] == lines[-1:], run.stderr
    assert match in lines[-1], lines[-1]
    assert "Traceback" not in run.stderr


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2:])
