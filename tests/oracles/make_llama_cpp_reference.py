r"""Record llama.cpp's answers to the tests' questions (llama.cpp as a recorded oracle).

The tests never load llama.cpp into the pytest process: its default build crashes on
some CPUs (``decode`` segfaults on Intel Xeons with AMX). This script runs
llama-cpp-python once, where it works, and writes what it computes to two small files
that tests/io/test_io_llama_gguf.py and tests/io/test_io_tokenizer.py compare against:

- ``llama_cpp_reference.json``: how the files were made (llama-cpp-python version,
  llama.cpp's CPU features, the CMake options of the build, the CPU, the command),
  llama.cpp's token ids for every tokenizer test string (the 326-string corpus with and
  without special tokens, and a fixed list of random Unicode strings drawn with
  hypothesis), the prompts' token ids and greedy continuations on SmolLM2, and the
  SHA-256 of each tiny GGUF file entrenar wrote for it to run;
- ``llama_cpp_logits.npz``: SmolLM2's logits for the first prompt (float16, every
  position), the top-8 ids and logits at each greedy step, and the tiny models' logits
  (every 16th vocabulary column, and the top-8 of each position);
- ``llama_cpp_families.json`` / ``.npz`` (tests/io/test_gguf_families.py): for each
  registered family entrenar writes as GGUF (and each of
  ``llama_cpp_cases.FAMILY_CASES``: Qwen2 with yarn and an attention factor,
  Command-R+'s per-head q/k norms at 64 layers, gpt-oss, Mixtral and Qwen3-MoE
  with MXFP4 experts), its
  tiny model (``llama_cpp_cases.family_config``) written by entrenar under the
  family's llama.cpp architecture, and llama.cpp's logits for it.
  ``--only-families`` writes only these two files.

The tiny models' weights come from integer hashing of a seed (see
``tests/io/llama_cpp_cases.py``) and are exact in F16 and Q4_0, so the file entrenar
writes, and what llama.cpp computes from it, are the same on every machine.

Usage, where llama.cpp runs (the recorded files were made this way)::

    export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_INT8=OFF \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF"
    pip install --no-cache-dir 'llama-cpp-python==0.3.36'   # builds llama.cpp (minutes)
    python tests/oracles/make_llama_cpp_reference.py --out tests/data \
        --cmake-args "$CMAKE_ARGS"

Exit status 77 means ``import llama_cpp`` failed. Two test hooks, honoured before
anything else: ``ENTRENAR_LLAMA_CPP_DIE=SEGV`` (any signal name without ``SIG``) makes
the process send itself that signal, as a crashing llama.cpp would;
``ENTRENAR_NO_LLAMA_CPP=1`` makes ``import llama_cpp`` fail as if it were not installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import sys
import tempfile
from pathlib import Path

NOT_IMPORTABLE = 77
TOP_K = 8
TINY_COLUMN_STEP = 16
F32_CACHE = 0  # GGML_TYPE_F32: the families' KV cache (llama.cpp's default is F16)
N_RANDOM_TEXTS = 200


def _random_texts() -> list[str]:
    """Unicode strings from the strategy the tokenizer's property test used to draw."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    drawn: list[str] = []
    chars = st.characters(codec="utf-8", exclude_categories=["Cs", "Cn"])

    @settings(
        max_examples=N_RANDOM_TEXTS, derandomize=True, database=None,
        phases=[Phase.generate], deadline=None,
    )  # fmt: skip
    @given(st.text(chars, max_size=40))
    def draw(s: str) -> None:
        if s not in drawn:
            drawn.append(s)

    draw()
    return drawn


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _tokens(llama_cpp, path: str, cases) -> dict:
    vocab = llama_cpp.Llama(path, vocab_only=True, verbose=False)

    def ids(s: str, special: bool) -> list[int]:
        return vocab.tokenize(s.encode("utf-8"), add_bos=False, special=special)

    return {
        "corpus": [[s, ids(s, False), ids(s, True)] for s in cases.corpus()],
        "random_text": [[s, ids(s, False)] for s in _random_texts()],
    }


def _top(row, k: int = TOP_K):
    import numpy as np

    top = np.argsort(-row, kind="stable")[:k]
    return top.astype(np.int32), row[top].astype(np.float32)


def _smollm2(llama_cpp, path: str, cases, arrays: dict) -> list[dict]:
    import numpy as np

    ll = llama_cpp.Llama(path, logits_all=True, n_ctx=64, verbose=False)
    out = []
    for i, prompt in enumerate(cases.PROMPTS):
        ids = ll.tokenize(prompt.encode("utf-8"), add_bos=False)
        ll.reset()
        ll.eval(ids)
        if i == 0:
            logits = np.array(ll.scores[: len(ids)], np.float32)  # (T, V)
            arrays["prompt0_logits"] = logits.astype(np.float16)
        greedy, top_ids, top_logits = [], [], []
        for _ in range(cases.GREEDY_STEPS):
            row = np.array(ll.scores[ll.n_tokens - 1], np.float32)  # (V,)
            t, v = _top(row)
            top_ids.append(t)
            top_logits.append(v)
            greedy.append(int(t[0]))
            ll.eval([greedy[-1]])
        arrays[f"greedy{i}_top_ids"] = np.stack(top_ids)  # (steps, k)
        arrays[f"greedy{i}_top_logits"] = np.stack(top_logits)
        out.append({"text": prompt, "ids": list(ids), "greedy": greedy})
    return out


def _tiny(llama_cpp, path: str, cases, arrays: dict) -> dict:
    import numpy as np

    from entrenar.io import read_gguf, save_llama_gguf

    config, params = cases.tiny_config(), cases.tiny_params(cases.tiny_config())
    cols = np.arange(0, config.vocab_size, TINY_COLUMN_STEP, dtype=np.int32)
    arrays["tiny_cols"] = cols
    source, out = read_gguf(path), {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in cases.TINY_KINDS:
            f = Path(tmp) / f"tiny-{kind}.gguf"
            save_llama_gguf(
                f, config, params, source=source, tensor_type=kind, embedding_type="F16"
            )
            ll = llama_cpp.Llama(str(f), logits_all=True, n_ctx=32, verbose=False)
            ll.eval(cases.TINY_IDS)
            logits = np.array(ll.scores[: len(cases.TINY_IDS)], np.float32)  # (T, V)
            arrays[f"tiny_{kind}_logits"] = logits[:, cols]
            tops = [_top(r) for r in logits]
            arrays[f"tiny_{kind}_top_ids"] = np.stack([t for t, _ in tops])
            arrays[f"tiny_{kind}_top_logits"] = np.stack([v for _, v in tops])
            out[kind] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
            del ll
    return out


def _families(llama_cpp, path: str, cases) -> tuple[dict, dict]:
    """Each registered family's tiny model, written by entrenar, run by llama.cpp.

    ``cases.family_config`` (the family's ``tiny()`` at SmolLM2's vocabulary, less
    what llama.cpp does not implement) with ``cases.family_params``, written as F32
    (MXFP4 experts for the cases of ``cases.WRITE_TYPES``) under the family's
    llama.cpp architecture with SmolLM2's tokenizer; its logits at
    ``cases.TINY_IDS`` (every ``TINY_COLUMN_STEP``-th column and the top-8 of each
    position), computed with a float32 KV cache, and the file's SHA-256.
    """
    import numpy as np

    from entrenar.io import read_gguf, save_llama_gguf

    source, record, arrays = read_gguf(path), {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in cases.family_cases():
            config = cases.family_config(family)
            f = Path(tmp) / f"{family}.gguf"
            save_llama_gguf(
                f, config, cases.family_params(config), source=source,
                **cases.write_types(family),
            )  # fmt: skip
            ll = llama_cpp.Llama(
                str(f), logits_all=True, n_ctx=32, verbose=False,
                type_k=F32_CACHE, type_v=F32_CACHE,
            )  # fmt: skip
            ll.eval(cases.TINY_IDS)
            logits = np.array(ll.scores[: len(cases.TINY_IDS)], np.float32)  # (T, V)
            arrays[f"{family}_logits"] = logits[:, ::TINY_COLUMN_STEP]
            tops = [_top(r) for r in logits]
            arrays[f"{family}_top_ids"] = np.stack([t for t, _ in tops])
            arrays[f"{family}_top_logits"] = np.stack([v for _, v in tops])
            record[family] = {
                "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                "architecture": read_gguf(f).metadata["general.architecture"],
            }
            del ll
    return record, arrays


def main(argv: list[str] | None = None) -> int:
    """Write the reference files; see the module docstring."""
    die = os.environ.get("ENTRENAR_LLAMA_CPP_DIE")
    if die:  # test hook: crash the way llama.cpp does on some CPUs
        os.kill(os.getpid(), getattr(signal, "SIG" + die.upper()))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write to")
    parser.add_argument(
        "--only-families",
        action="store_true",
        help="write only the per-family files (llama_cpp_families.json/.npz)",
    )
    parser.add_argument(
        "--cmake-args",
        default="",
        help="the CMAKE_ARGS llama-cpp-python was built with",
    )
    args = parser.parse_args(argv)
    if os.environ.get("ENTRENAR_NO_LLAMA_CPP"):  # test hook: as if not installed
        sys.modules["llama_cpp"] = None  # type: ignore[assignment]
    try:
        import llama_cpp
    except ImportError as e:
        print(f"cannot import llama_cpp: {e}", file=sys.stderr)
        return NOT_IMPORTABLE

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
    import llama_cpp_cases as cases
    import numpy as np

    from entrenar.io import smollm2_path

    path = smollm2_path()
    how = {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "cmake_args": args.cmake_args,
        "cpu": _cpu(),
        "command": "python tests/oracles/make_llama_cpp_reference.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": os.path.basename(path),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    families, family_arrays = _families(llama_cpp, path, cases)
    with open(args.out / cases.FAMILIES_JSON, "w", encoding="utf-8") as f:
        json.dump({"how": how, "families": families}, f, indent=0)
        f.write("\n")
    np.savez_compressed(args.out / cases.FAMILIES_NPZ, **family_arrays)
    if args.only_families:
        return 0
    arrays: dict = {}
    record = {
        "how": how,
        "prompts": _smollm2(llama_cpp, path, cases, arrays),
        "tiny": _tiny(llama_cpp, path, cases, arrays),
        "tokens": _tokens(llama_cpp, path, cases),
    }
    with open(args.out / cases.REFERENCE_JSON, "w", encoding="utf-8") as f:
        json.dump(record, f, ensure_ascii=False, indent=0)
        f.write("\n")
    np.savez_compressed(args.out / cases.REFERENCE_NPZ, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
