r"""Record llama.cpp's tokenization of GGUF files whose tokenizer entrenar wrote.

For each tiny tokenizer style of tests/io/hf_cases.py (byte-level BPE split by the
GPT-2, Llama 3 and Qwen2 regexes; SentencePiece-style BPE with and without the
prepended ``▁``), entrenar writes the family's tiny model with that tokenizer
(`entrenar.io.save_llama_gguf(tokenizer=HFTokenizer)`), and llama.cpp tokenizes
``hf_cases.GGUF_TEXTS`` from the file, with and without special tokens, and
``"Hello"`` with BOS. The answers go to ``llama_cpp_gguf_tokenizer.json``, which
tests/io/test_gguf_tokenizer.py compares entrenar's ids against. Each style records
the SHA-256 of the tiny tokenizer's vocabulary and merges and of the tokenizer fields
entrenar wrote, so that a test can tell a tiny tokenizer trained differently (by
another ``tokenizers`` version: re-record) from a changed conversion.

The script runs in entrenar's environment and tokenizes in a subprocess of the Python
that has llama-cpp-python (``--llama-python``, default this one), which needs only
``llama_cpp`` (no entrenar)::

    .venv/bin/python tests/oracles/make_gguf_tokenizer_reference.py --out tests/data \
        --llama-python /tmp/llamavenv/bin/python

Exit status 77: ``import llama_cpp`` failed in that Python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

NOT_IMPORTABLE = 77
RECORD = "llama_cpp_gguf_tokenizer.json"
STYLE_FAMILY = {
    "llama": "llama",
    "llama3_split": "llama",
    "qwen": "qwen2",
    "qwen2_split": "qwen2",
    "mistral": "mistral",
    "phi3": "phi3",
    "gemma": "gemma2",
}
"""Each tiny tokenizer style and the family of the model written with it."""


def fields_digest(fields: dict) -> str:
    """SHA-256 of GGUF tokenizer fields (`entrenar.io.gguf_tokenizer` output)."""
    doc = {k: f.value for k, f in sorted(fields.items())}
    text = json.dumps(doc, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def vocab_digest(tokenizer_json: str) -> str:
    """SHA-256 of a ``tokenizer.json``'s vocabulary, merges and added tokens."""
    doc = json.loads(tokenizer_json)
    parts = [doc["model"].get("vocab"), doc["model"].get("merges"), doc["added_tokens"]]
    text = json.dumps(parts, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_files(work: Path, styles: list[str]) -> dict:
    """Write each style's tokenizer folder and GGUF under ``work``; the manifest."""
    here = Path(__file__).resolve().parents[1] / "io"
    sys.path.insert(0, str(here))
    import dataclasses

    import hf_cases
    import llama_cpp_cases

    from entrenar import io
    from entrenar.io.gguf_tokenizer import gguf_tokenizer_fields

    manifest: dict = {"texts": hf_cases.GGUF_TEXTS, "styles": {}}
    for style in styles:
        family = STYLE_FAMILY[style]
        hf_cases.write_tokenizer(work / style, style)
        tok = io.HFTokenizer.from_folder(work / style)
        config = dataclasses.replace(
            llama_cpp_cases.family_config(family), vocab_size=tok.vocab_size
        )
        params = llama_cpp_cases.family_params(config)
        path = work / f"{style}.gguf"
        io.save_llama_gguf(path, config, params, tokenizer=tok)
        fields = gguf_tokenizer_fields(tok, vocab_size=config.vocab_size)
        manifest["styles"][style] = {
            "family": family,
            "gguf": str(path),
            "model": fields["tokenizer.ggml.model"].value,
            "pre": fields["tokenizer.ggml.pre"].value,
            "vocab_sha256": vocab_digest(tok.text),
            "fields_sha256": fields_digest(fields),
        }
    return manifest


def tokenize(manifest_path: Path) -> int:
    """llama.cpp's ids for the manifest's texts, written beside it (subprocess)."""
    try:
        import llama_cpp
    except ImportError as e:
        print(f"import llama_cpp failed: {e}", file=sys.stderr)
        return NOT_IMPORTABLE
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    out: dict = {"llama_cpp_python": llama_cpp.__version__, "styles": {}}
    for style, info in manifest["styles"].items():
        vocab = llama_cpp.Llama(info["gguf"], vocab_only=True, verbose=False)
        cases = [
            {"text": t, "special": sp, "ids": vocab.tokenize(t.encode(), False, sp)}
            for sp in (False, True)
            for t in manifest["texts"]
        ]
        bos = vocab.tokenize(b"Hello", add_bos=True, special=False)
        out["styles"][style] = {"with_bos": bos, "cases": cases}
    manifest_path.with_name("ids.json").write_text(json.dumps(out), "utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write the GGUFs, tokenize them with llama.cpp, record the answers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder to write the record to")
    parser.add_argument("--llama-python", default=sys.executable)
    parser.add_argument("--styles", nargs="*", default=list(STYLE_FAMILY))
    parser.add_argument("--tokenize", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokenize is not None:
        return tokenize(args.tokenize)
    if args.out is None:
        parser.error("--out is required")
    with tempfile.TemporaryDirectory(prefix="gguf_tok_") as tmp:
        work = Path(tmp)
        manifest = write_files(work, args.styles)
        (work / "manifest.json").write_text(json.dumps(manifest), "utf-8")
        cmd = [args.llama_python, __file__, "--tokenize", str(work / "manifest.json")]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            sys.stderr.write(p.stderr[-2000:])
            return p.returncode if p.returncode > 0 else 1
        ids = json.loads((work / "ids.json").read_text(encoding="utf-8"))
    record = {"llama_cpp_python": ids["llama_cpp_python"], "styles": {}}
    for style, info in manifest["styles"].items():
        info = {k: v for k, v in info.items() if k != "gguf"}
        record["styles"][style] = info | ids["styles"][style]
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    (args.out / RECORD).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
