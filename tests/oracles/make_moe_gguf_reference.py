r"""Record llama.cpp's converter and logits on tiny mixture-of-experts GGUF files.

For each MoE family (``mixtral``, ``qwen3_moe``, ``qwen2_moe``, ``olmoe``,
``granitemoe``, ``granitemoeshared``, ``deepseek_v3``, ``deepseek_v2``,
``glm4_moe``) this script

1. writes a tiny random transformers model (``CASES``: the family's tiny config with
   the routing llama.cpp implements: Mixtral and Qwen3-MoE renormalise their top-k
   weights, Qwen2-MoE does not) to a folder, its weights drawn with
   ``torch.manual_seed(0)`` from N(0, 0.2²) and rounded to float16;
2. runs llama.cpp's ``convert_hf_to_gguf.py`` on it (``--outtype f16``) into
   ``tests/data/llama_cpp_moe/<family>.gguf`` (its vocabulary step on the GPT-2
   path, as tests/oracles/make_converter_reference.py does);
3. records transformers' logits for ``TOKENS`` (``reference.npz``, ``<family>_hf``);
4. has entrenar read the converter's file and write it again
   (`entrenar.io.save_llama_gguf`, F32, the converter's file as ``source``: ggml
   multiplies F16 weights by activations rounded to F16, 4e-4 off these logits,
   F32 ones in float32) and runs
   llama.cpp (llama-cpp-python, in ``--llama-python``'s process) on both files,
   recording its logits (``<family>_cpp_converted``, ``<family>_cpp_entrenar``,
   float32 KV cache) and the SHA-256 of each file (``reference.json``).

tests/io/test_gguf_moe.py compares entrenar against these without llama.cpp or a
network. Usage (the recorded files were made so)::

    pip download --no-binary :all: llama-cpp-python==0.3.36   # vendor/llama.cpp
    .venv/bin/python tests/oracles/make_moe_gguf_reference.py \
        --llama-cpp /path/to/vendor/llama.cpp --llama-python /tmp/llvenv/bin/python \
        --out tests/data/llama_cpp_moe

``--only olmoe granitemoe`` records those cases alone, keeping the other cases'
files, arrays and record as they are.
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
sys.path.insert(0, str(ROOT / "tests" / "oracles"))
from make_converter_reference import CONVERT, VOCAB  # noqa: E402

TOKENS = [[(7 * i) % 90 for i in range(11)]]  # (1, 11)
CASES: dict[str, dict[str, Any]] = {
    "mixtral": dict(sliding_window=None),
    "qwen3_moe": dict(
        norm_topk_prob=True, attention_bias=False, attention_out_bias=False
    ),
    "qwen2_moe": dict(
        norm_topk_prob=False, sliding_window=None, layer_types=None, head_dim=8
    ),
    "olmoe": dict(
        clip_qkv=None, attention_bias=False, attention_out_bias=False, num_kv_heads=4
    ),
    "granitemoe": dict(head_dim=None),
    "granitemoeshared": dict(head_dim=None),
    "deepseek_v3": dict(rope_attention_factor=1.0),
    "deepseek_v2": dict(
        rope_attention_factor=1.0,
        q_lora_rank=24,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
    ),
    "glm4_moe": {},
}
"""Family -> fields replaced in its tiny config: llama.cpp's routing, no windows
(llama.cpp's llama and qwen2moe have none), Qwen3-MoE without biases (as released),
Qwen2-MoE's heads ``D / H`` wide (llama.cpp's qwen2moe sizes q as ``(D, D)``),
OLMoE without clipping, biases or GQA (olmoe.cpp has neither an o_proj bias nor a
clamp, transformers' attention_bias is all four, and its k norm is n_embd wide),
Granite MoE's heads ``D / H`` wide (its converter drops ``head_dim``), DeepSeek with
YaRN's ``cos``/``sin`` unscaled (as the released configs, ``mscale`` =
``mscale_all_dim``: the converter writes no attention factor llama.cpp reads), V2
with a low-rank query (llama.cpp needs ``q_lora_rank`` but for 26/27-layer models,
and the converter writes none for ``q_proj``) and greedy routing over one group
(llama.cpp ranks groups as V3)."""

RUN_LLAMA_CPP = r"""
import json, sys
import numpy as np
import llama_cpp
tokens = json.loads(sys.argv[2])
out = {}
for path in sys.argv[3:]:
    ll = llama_cpp.Llama(path, logits_all=True, n_ctx=32, verbose=False,
                         type_k=0, type_v=0)
    ll.eval(tokens)
    out[path] = np.array(ll.scores[: len(tokens)], np.float32)
    del ll
np.savez(sys.argv[1], **{str(i): out[p] for i, p in enumerate(sys.argv[3:])})
print(llama_cpp.__version__)
"""
"""Run by ``--llama-python``: llama.cpp's logits of each file (float32 KV cache)."""


def _folder(family: str, folder: Path) -> Any:
    """Write ``family``'s tiny transformers model into ``folder``; returns it."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests" / "io"))
    import hf_cases

    from entrenar import nn

    arch = nn.architecture(family)
    config = dataclasses.replace(arch.tiny(), vocab_size=VOCAB, **CASES[family])
    hf_cases.write_tokenizer(folder, "qwen2")
    (folder / "config.json").write_text(json.dumps(arch.to_hf(config)))
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.normal_(0.0, 0.2).half().float())
    model.save_pretrained(folder)
    return model


def main() -> None:
    """Write the files under ``--out`` (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--llama-python", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=None)
    args = parser.parse_args()
    import numpy as np
    import torch
    import transformers

    from entrenar import io

    args.out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "how": {
            "llama_cpp": str(args.llama_cpp),
            "command": " ".join(sys.argv),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokens": TOKENS,
        },
        "cases": {},
    }
    arrays: dict[str, np.ndarray] = {}
    if args.only:  # the other cases as recorded
        record = json.loads((args.out / "reference.json").read_text())
        record["how"]["command_" + "_".join(args.only)] = " ".join(sys.argv)
        with np.load(args.out / "reference.npz") as z:
            arrays = dict(z)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.only or CASES:
            folder = Path(tmp) / family
            model = _folder(family, folder)
            converted = args.out / f"{family}.gguf"
            subprocess.run(
                [sys.executable, "-c", CONVERT, str(args.llama_cpp), str(folder),
                 "--outtype", "f16", "--outfile", str(converted)],
                check=True,
            )  # fmt: skip
            with torch.no_grad():
                arrays[f"{family}_hf"] = model(torch.tensor(TOKENS)).logits.numpy()
            ours = Path(tmp) / f"{family}.entrenar.gguf"
            config, params, _ = io.load_llama_gguf(converted)
            io.save_llama_gguf(
                ours, config, params, source=converted, tensor_type="F32"
            )
            npz = Path(tmp) / "cpp.npz"
            version = subprocess.run(
                [args.llama_python, "-c", RUN_LLAMA_CPP, str(npz),
                 json.dumps(TOKENS[0]), str(converted), str(ours)],
                check=True, capture_output=True, text=True,
            ).stdout.strip()  # fmt: skip
            with np.load(npz) as z:
                arrays[f"{family}_cpp_converted"] = z["0"]
                arrays[f"{family}_cpp_entrenar"] = z["1"]
            record["how"]["llama_cpp_python"] = version
            record["cases"][family] = {
                "config.json": json.loads((folder / "config.json").read_text()),
                "sha256": hashlib.sha256(converted.read_bytes()).hexdigest(),
                "entrenar_sha256": hashlib.sha256(ours.read_bytes()).hexdigest(),
            }
    np.savez_compressed(args.out / "reference.npz", **arrays)
    text = json.dumps(record, indent=1, sort_keys=True)
    (args.out / "reference.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
