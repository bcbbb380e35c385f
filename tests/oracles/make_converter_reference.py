r"""Record what llama.cpp's own converter makes of tiny Hugging Face folders.

llama.cpp's ``convert_hf_to_gguf.py`` is the other writer of the GGUF files entrenar
reads; this script runs it on a tiny random transformers model of each case below and
records, in ``tests/data/llama_cpp_converted/``, the GGUF it writes (F16, under 90 kB
each) and transformers' logits for the folder (``reference.npz``, float32), so that
tests/io/test_gguf_families.py can check that entrenar reads the converter's file to
transformers' numbers, without llama.cpp or a network:

- ``qwen2_yarn``: Qwen2 with ``rope_scaling`` yarn (factor 4, original context 32) and
  an explicit ``attention_factor`` 0.8, which the converter keeps in
  ``qwen2.rope.scaling.yarn_attn_factor`` (llama.cpp itself reads only
  ``rope.scaling.attn_factor``);
- ``phi3_no_window``: Phi-3 with ``sliding_window: null`` (as Phi-4's config), which
  the converter writes as ``phi3.attention.sliding_window = 0``; LongRoPE, with 11
  tokens past the original context of 8, so the long factors are used;
- one case per family added since (named after it: ``gemma``, ...), each the
  family's tiny config less what llama.cpp's graph or converter lacks (commented
  at the case), so that tests/io/test_gguf_families.py can also check that
  entrenar writes the converter's tensors and keys.

The weights are drawn with ``torch.manual_seed(0)`` from N(0, 0.2²) and rounded to
float16 before the folder is saved, so the F16 file holds them exactly. The
tokenizer is tests/io/hf_cases.py's byte-level one (``qwen``); the converter's
pre-tokenizer check (a hash of known tokenizers) and its SentencePiece paths are
replaced by its GPT-2 path (``_set_vocab_gpt2``), since a tokenizer trained in a test
has no known hash; the tokenizer is not what these files check.

Usage, with a llama.cpp checkout (its ``gguf-py`` is put first on the path; the
recorded files were made with the one vendored in llama-cpp-python 0.3.36's sdist,
``pip download --no-binary :all: llama-cpp-python==0.3.36``)::

    .venv/bin/python tests/oracles/make_converter_reference.py \
        --llama-cpp /path/to/llama.cpp --out tests/data/llama_cpp_converted \
        --llama-cpp-version "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp"
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOKENS = [[(7 * i) % 90 for i in range(11)]]  # (1, 11)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_yarn": (
        "qwen2",
        dict(sliding_window=None, layer_types=None, rope_attention_factor=0.8),
    ),
    "phi3_no_window": (
        "phi3",
        dict(sliding_window=None, hidden_size=32, num_heads=2, num_kv_heads=1),
    ),
    # the converter's Gemma writes no rope keys and llama.cpp's graph no biases
    "gemma": (
        "gemma",
        dict(
            rope_type="default",
            rope_factor=1.0,
            attention_bias=False,
            attention_out_bias=False,
        ),
    ),
    # llama.cpp's SmolLM3 has no sliding window and no biases
    "smollm3": (
        "smollm3",
        dict(
            sliding_window=None,
            layer_types=None,
            attention_bias=False,
            attention_out_bias=False,
            mlp_bias=False,
        ),
    ),
    # llama.cpp's OLMo 2 has no biases
    "olmo2": ("olmo2", dict(attention_bias=False, attention_out_bias=False)),
    # llama.cpp's OLMo 3 (its olmo2) has no biases and one rotary base
    "olmo3": (
        "olmo3",
        dict(
            attention_bias=False, attention_out_bias=False, rope_local_theta=500_000.0
        ),
    ),
    # llama.cpp's Granite has no q/k/v biases; its converter drops head_dim
    "granite": (
        "granite",
        dict(
            attention_bias=False,
            attention_out_bias=False,
            mlp_bias=False,
            head_dim=None,
        ),
    ),
    # llama.cpp's Cohere graphs: no o_proj bias (the converter keeps biases), no
    # rope scaling (the converter writes none), d = D / H (attn_output {D, D}; the
    # cohere2 converter rotates D / H values); command-r's q/k norms need 64 layers
    "cohere": (
        "cohere",
        dict(
            head_dim=None,
            attention_bias=False,
            attention_out_bias=False,
            qk_norm=False,
            qk_norm_heads=False,
            rope_type="default",
            rope_factor=1.0,
        ),
    ),
    # the converter writes no layer pattern (llama.cpp's default, period 4: four
    # layers, the last full) and drops biases
    "cohere2": (
        "cohere2",
        dict(
            num_layers=4,
            head_dim=None,
            layer_types=("sliding_attention",) * 3 + ("full_attention",),
            nope_layers=(False, False, False, True),
            attention_bias=False,
            attention_out_bias=False,
            rope_type="default",
            rope_factor=1.0,
        ),
    ),
    # GLM-4 as it is: biases, 12 of 16 values rotated in pairs, four norms
    "glm4": ("glm4", {}),
    # llama.cpp's exaone4 slides only at 64 layers: EXAONE 4.0 1.2B's layout
    # (every layer global, rotating; llama3 rope as rope_freqs), heads filling D
    "exaone4": (
        "exaone4",
        dict(sliding_window=None, layer_types=None, nope_layers=None, hidden_size=64),
    ),
    # EXAONE 4.0 32B's 64 layers (the converter writes the pattern as booleans),
    # narrow so the file stays small
    "exaone4_swa": (
        "exaone4",
        dict(
            num_layers=64,
            hidden_size=16,
            num_heads=2,
            num_kv_heads=1,
            head_dim=8,
            intermediate_size=16,
            sliding_window=4,
            layer_types=tuple(
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                for i in range(64)
            ),
            nope_layers=tuple((i + 1) % 4 == 0 for i in range(64)),
        ),
    ),
    # Ministral 3 with the Hub's rope_parameters (HUB_KEYS): yarn with mscale =
    # mscale_all_dim = 1, which the converter writes as yarn_log_multiplier
    "ministral3": ("ministral3", dict(rope_attention_factor=1.0)),
}
"""Case -> (family, fields replaced in the family's tiny config)."""
HUB_KEYS: dict[str, dict[str, Any]] = {
    "cohere": {"head_dim": None},
    "cohere2": {"head_dim": None, "rotary_pct": 1.0},
    "ministral3": {
        "rope_parameters": {
            "rope_type": "yarn",
            "type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
            "rope_theta": 10000.0,
        },
    },
}
"""config.json keys set as the Hub's files have them, after ``save_pretrained``
(None: no such key): Cohere's files have no ``head_dim`` (``D / H``; the converter
would write it as ``attention.key_length``), Command-R7B's has ``rotary_pct``, which
the cohere2 converter reads (transformers ignores it); Ministral 3's rope has
``mscale`` and ``mscale_all_dim`` (their ratio, 1, is the ``attention_factor``
entrenar writes), which the converter needs."""
VOCAB = 320  # the byte-level tiny tokenizer's 303 tokens, rounded up

CONVERT = r"""
import sys
llama_cpp = sys.argv.pop(1)
sys.path[:0] = [llama_cpp + "/gguf-py", llama_cpp]
import conversion, importlib, pkgutil
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def gpt2_vocab(self):
    self._set_vocab_gpt2()
for m in pkgutil.iter_modules(conversion.__path__):
    try:
        mod = importlib.import_module("conversion." + m.name)
    except Exception:
        continue
    for v in vars(mod).values():
        if isinstance(v, type) and issubclass(v, base.TextModel):
            if "set_vocab" in vars(v):
                v.set_vocab = gpt2_vocab
sys.argv[0] = llama_cpp + "/convert_hf_to_gguf.py"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""
"""Runs the converter with its vocabulary step on the GPT-2 path (module docstring)."""


def _folder(case: str, folder: Path) -> Any:
    """Write the case's tiny transformers model into ``folder``; returns the model."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests" / "io"))
    import hf_cases

    from entrenar import nn

    family, fields = CASES[case]
    arch = nn.architecture(family)
    if arch.tiny is None or arch.to_hf is None:
        raise SystemExit(f"{family} has no tiny config or config.json form")
    config = dataclasses.replace(arch.tiny(), vocab_size=VOCAB, **fields)
    hf_cases.write_tokenizer(folder, "qwen2")
    (folder / "config.json").write_text(json.dumps(arch.to_hf(config)))
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.normal_(0.0, 0.2).half().float())
    model.save_pretrained(folder)
    if case in HUB_KEYS:
        hf = json.loads((folder / "config.json").read_text())
        for key, value in HUB_KEYS[case].items():
            if value is None:
                hf.pop(key, None)
            else:
                hf[key] = value
        (folder / "config.json").write_text(json.dumps(hf, indent=2))
    return model


def main() -> None:
    """Convert each case and write the GGUF files and the logits under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--llama-cpp-version", default="", help="where the checkout came from"
    )
    args = parser.parse_args()
    import numpy as np
    import torch
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "how": {
            "llama_cpp": args.llama_cpp_version or str(args.llama_cpp),
            "gguf_py": (args.llama_cpp / "gguf-py/pyproject.toml")
            .read_text()
            .split('version = "')[1]
            .split('"')[0],
            "command": " ".join(sys.argv),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokens": TOKENS,
        },
        "cases": {},
    }
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            folder = Path(tmp) / case
            model = _folder(case, folder)
            out = args.out / f"{case}.gguf"
            subprocess.run(
                [sys.executable, "-c", CONVERT, str(args.llama_cpp), str(folder),
                 "--outtype", "f16", "--outfile", str(out)],
                check=True,
            )  # fmt: skip
            with torch.no_grad():
                logits[case] = model(torch.tensor(TOKENS)).logits.numpy()
            config = json.loads((folder / "config.json").read_text())
            record["cases"][case] = {
                "config.json": config,
                "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
            }
    np.savez_compressed(args.out / "reference.npz", **logits)
    text = json.dumps(record, indent=1, sort_keys=True)
    (args.out / "reference.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
