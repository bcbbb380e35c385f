"""The memory plan at real big shapes, and a measured run at the same width.

No model above 135M can be downloaded here, and a 30B model's weights do not fit on
this machine's disk twice, so each shape is a *sparse* Hugging Face folder: one
``model.safetensors`` whose header lists every tensor of the real shape (bfloat16)
and whose data is a hole (``truncate``: zeros, no disk used), plus SmolLM2's
tokenizer (`scale_models.write_hf_folder`'s). The plan reads headers only, so it is
the plan of the real model; a run reads zeros, which costs the memory real weights
would (NF4 codes and scales included), though not their numerics.

For each case this prints the plan of the whole model and, with ``--measure``,
the plan and the measured peak (``VmHWM`` of a fresh ``entrenar train`` process,
2 steps) of the same width with ``--layers`` layers.

Cases: Qwen3-30B-A3B QLoRA on q/k/v/o with ``lora.quantize_untargeted`` (its
experts NF4 without adapters) and without it; Moonlight-16B-A3B and
DeepSeek-V2-Lite QLoRA on the latent attention's projections, untargeted NF4;
Llama-3-8B bfloat16 LoRA (not quantized) on every linear layer; TinyLlama-1.1B
full fine-tuning in float32 with AdamW and with ``adamw_8bit``; the models people
QLoRA on one 24 GB GPU (``<model>-qlora-all``: Qwen2.5-14B, Qwen3-14B,
Mistral-Small-24B, Gemma-3-27B's text model, Qwen2.5-32B, Qwen3-32B), NF4 bases with
``quantize_untargeted``, rank 16 on every linear layer; Gemma-3-27B again with
``model.tied_head_copy: false`` (no transposed copy of the tied head); Qwen2.5-32B and
Qwen3-32B with ``model.llama_options: {remat_saved_dtype: bfloat16}``
(``-bf16-saved``), and with it ``mlp_chunk_elements: 4194304`` and ``adamw_8bit``
(``-24gb``). Batch 1 x 2048
(``--seqs`` adds lengths planned whole; measured runs 1 x 512), ``nothing_saveable``,
bfloat16 matmuls, AdamW unless named.

Usage: ``python benchmarks/big_shapes_memory.py [--cases ...] [--measure]
[--layers 4] [--seqs 2048,512] [--out /tmp/entrenar-big-shapes]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from typing import Any

from machine import cpu_name

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

QWEN3_30B_A3B = dict(
    family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48,
    num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960,
    tie_word_embeddings=False, rms_norm_eps=1e-6,
)  # fmt: skip
LLAMA3_8B = dict(
    family="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
    num_heads=32, num_kv_heads=8, intermediate_size=14336, rope_theta=500000.0,
    max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-5,
)  # fmt: skip
TINYLLAMA_1B = dict(
    family="llama", vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32,
    num_kv_heads=4, intermediate_size=5632, rope_theta=10000.0,
    max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5,
)  # fmt: skip
MOONLIGHT_16B_A3B = dict(
    family="deepseek_v3", vocab_size=163840, hidden_size=2048, num_layers=27,
    num_heads=16, num_kv_heads=16, intermediate_size=11264,
    moe_intermediate_size=1408, num_experts=64, num_experts_per_tok=6,
    n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    routed_scaling_factor=2.446, rope_theta=50000.0, max_position_embeddings=8192,
    tie_word_embeddings=False, rms_norm_eps=1e-5,
)  # fmt: skip
DEEPSEEK_V2_LITE = dict(
    MOONLIGHT_16B_A3B, family="deepseek_v2", vocab_size=102400,
    intermediate_size=10944, routed_scaling_factor=1.0, rope_theta=10000.0,
    max_position_embeddings=163840, rms_norm_eps=1e-6,
)  # fmt: skip
QWEN25_14B = dict(
    family="qwen2", vocab_size=152064, hidden_size=5120, num_layers=48,
    num_heads=40, num_kv_heads=8, intermediate_size=13824, rope_theta=1e6,
    max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6,
)  # fmt: skip
QWEN3_14B = dict(
    family="qwen3", vocab_size=151936, hidden_size=5120, num_layers=40,
    num_heads=40, num_kv_heads=8, head_dim=128, intermediate_size=17408,
    rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)  # fmt: skip
MISTRAL_SMALL_24B = dict(
    family="mistral", vocab_size=131072, hidden_size=5120, num_layers=40,
    num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=32768,
    rope_theta=1e8, max_position_embeddings=32768, tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)  # fmt: skip
GEMMA3_27B = dict(
    family="gemma3", vocab_size=262208, hidden_size=5376, num_layers=62,
    num_heads=32, num_kv_heads=16, head_dim=128, intermediate_size=21504,
    query_pre_attn_scalar=168.0, sliding_window=1024, rope_theta=1e6,
    max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-6,
)  # fmt: skip
QWEN25_32B = dict(
    family="qwen2", vocab_size=152064, hidden_size=5120, num_layers=64,
    num_heads=40, num_kv_heads=8, intermediate_size=27648, rope_theta=1e6,
    max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-5,
)  # fmt: skip
QWEN3_32B = dict(
    family="qwen3", vocab_size=151936, hidden_size=5120, num_layers=64,
    num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=25600,
    rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)  # fmt: skip
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
CASES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b-qlora-attn-untargeted": dict(
        shape=QWEN3_30B_A3B, targets=ATTENTION, quantize="nf4", untargeted=True
    ),
    "qwen3-30b-a3b-qlora-attn": dict(
        shape=QWEN3_30B_A3B, targets=ATTENTION, quantize="nf4", untargeted=False
    ),
    "moonlight-16b-a3b-qlora-attn-untargeted": dict(
        shape=MOONLIGHT_16B_A3B, targets=MLA, quantize="nf4", untargeted=True
    ),
    "deepseek-v2-lite-qlora-attn-untargeted": dict(
        shape=DEEPSEEK_V2_LITE, targets=MLA, quantize="nf4", untargeted=True
    ),
    "llama3-8b-bf16-lora-all": dict(
        shape=LLAMA3_8B, targets="all-linear", quantize="none", untargeted=False
    ),
    **{
        f"{name}-qlora-all": dict(
            shape=shape, targets="all-linear", quantize="nf4", untargeted=True
        )
        for name, shape in [
            ("qwen2.5-14b", QWEN25_14B),
            ("qwen3-14b", QWEN3_14B),
            ("mistral-small-24b", MISTRAL_SMALL_24B),
            ("gemma3-27b", GEMMA3_27B),
            ("qwen2.5-32b", QWEN25_32B),
            ("qwen3-32b", QWEN3_32B),
        ]
    },
    "gemma3-27b-qlora-all-no-head-copy": dict(
        shape=GEMMA3_27B,
        targets="all-linear",
        quantize="nf4",
        untargeted=True,
        model={"tied_head_copy": False},
    ),
    **{
        f"{name}-qlora-all-bf16-saved": dict(
            shape=shape,
            targets="all-linear",
            quantize="nf4",
            untargeted=True,
            model={"llama_options": {"remat_saved_dtype": "bfloat16"}},
        )
        for name, shape in [("qwen2.5-32b", QWEN25_32B), ("qwen3-32b", QWEN3_32B)]
    },
    **{
        f"{name}-qlora-all-24gb": dict(
            shape=shape,
            targets="all-linear",
            quantize="nf4",
            untargeted=True,
            model={
                "llama_options": {
                    "remat_saved_dtype": "bfloat16",
                    "mlp_chunk_elements": 1 << 22,
                }
            },
            optimizer="adamw_8bit",
        )
        for name, shape in [("qwen2.5-32b", QWEN25_32B), ("qwen3-32b", QWEN3_32B)]
    },
    "tinyllama-1.1b-f32-full-adamw": dict(shape=TINYLLAMA_1B, dtype="float32"),
    "tinyllama-1.1b-f32-full-adamw_8bit": dict(
        shape=TINYLLAMA_1B, dtype="float32", optimizer="adamw_8bit"
    ),
}


def write_sparse_folder(folder: str, shape: dict[str, Any], layers: int) -> None:
    """A Hugging Face folder of ``shape`` with ``layers`` layers, its data a hole."""
    from scale_models import smollm2_tokenizer_fields

    from entrenar import io, nn
    from entrenar.io.gguf_tokenizer import hf_json_from_gguf
    from entrenar.nn.hf_names import per_layer_shapes

    fields = {k: v for k, v in shape.items() if k not in ("family", "num_layers")}
    cfg = nn.architecture(shape["family"]).make_config(**fields, num_layers=layers)
    header, offset = {}, 0
    for name, dims in sorted(per_layer_shapes(cfg).items()):
        n = 2 * math.prod(dims)  # bfloat16
        header[name] = {"dtype": "BF16", "shape": list(dims),
                        "data_offsets": [offset, offset + n]}  # fmt: skip
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # the data: a hole of zeros
    hf = nn.architecture_of(cfg).to_hf(cfg) | {"torch_dtype": "bfloat16"}
    tok = smollm2_tokenizer_fields(min(cfg.vocab_size, 49152))
    g = io.read_gguf(io.smollm2_path())
    files = {
        "config.json": json.dumps(hf),
        "tokenizer.json": hf_json_from_gguf({k: t.value for k, t in tok.items()}),
        "tokenizer_config.json": json.dumps({
            "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
            "pad_token": "<|im_end|>", "tokenizer_class": "GPT2Tokenizer",
            "chat_template": g.metadata.get("tokenizer.chat_template"),
        }),
    }  # fmt: skip
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def write_yaml(case: str, folder: str, seq: int, out: str) -> str:
    c = CASES[case]
    doc = {
        "model": {"path": folder, "dtype": c.get("dtype", "bfloat16"),
                  "matmul_dtype": "bfloat16", "remat_policy": "nothing_saveable",
                  **c.get("model", {})},
        "data": {"train": os.path.join(HERE, "..", "examples", "data", "iso_dates",
                                       "train.jsonl"),
                 "format": "chat", "batch_size": 1, "seq_len": seq},
        "optimizer": {"name": c.get("optimizer", "adamw"), "lr": 1e-4},
        "training": {"max_steps": 2, "log_every": 1,
                     "output_dir": os.path.join(out, "runs", case)},
        "export": {"formats": ["adapter" if "targets" in c else "safetensors"]},
    }  # fmt: skip
    if "targets" in c:  # LoRA; else full fine-tuning
        doc["lora"] = {"rank": 16, "alpha": 32, "targets": c["targets"],
                       "quantize_base": c["quantize"],
                       "quantize_untargeted": c["untargeted"]}  # fmt: skip
    path = os.path.join(out, f"{case}-{os.path.basename(folder)}-{seq}.yaml")
    with open(path, "w") as f:
        json.dump(doc, f)  # JSON is YAML
    return path


def main() -> None:
    import memory_plan  # benchmarks/memory_plan.py: predict / measure in children

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", default="2048", help="sequence lengths planned whole")
    ap.add_argument("--out", default="/tmp/entrenar-big-shapes")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    print("| case | layers | seq | plan: load / train / peak (GB) | measured (GB) |")
    print("|---|---|---|---|---|")
    for case in args.cases.split(","):
        shape = CASES[case]["shape"]
        runs = [(shape["num_layers"], int(n), False) for n in args.seqs.split(",")]
        if args.measure:
            runs.append((args.layers, 512, True))
        for layers, seq, measured in runs:
            name = f"{shape['family']}-{shape['hidden_size']}-"
            name += f"{shape['intermediate_size']}-{layers}"
            folder = os.path.join(args.out, name)
            if not os.path.exists(os.path.join(folder, "config.json")):
                write_sparse_folder(folder, shape, layers)
            yaml = write_yaml(case, folder, seq, args.out)
            p = memory_plan.child("predict", yaml)
            m = memory_plan.child("measure", yaml)["peak"] if measured else None
            plan = " / ".join(f"{p[k] / 1e9:.2f}" for k in ("load", "train", "peak"))
            got = f"{m / 1e9:.2f}" if m is not None else "-"
            print(f"| {case} | {layers} | {seq} | {plan} | {got} |", flush=True)
            parts = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in p["parts"].items())
            print(f"  parts (GB): {parts}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
