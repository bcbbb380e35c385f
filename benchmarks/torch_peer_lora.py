"""Peer for benchmarks/gpu_check.py: LoRA steps in PyTorch + transformers + PEFT.

What a user would run instead of entrenar on a GPU: `LlamaForCausalLM` (random
weights made on the device, in bfloat16, SDPA attention), PEFT LoRA on every linear
layer of the blocks (rank and alpha as given), `torch.optim.AdamW` on the adapters,
labels = inputs. Each case is one JSON line on stdout, printed as soon as it is
measured: median seconds per step over ``--steps`` after two warm-up steps, tokens/s,
the peak of `torch.cuda.max_memory_allocated` (reset per case) on a GPU. A case that
fails (out of memory) prints its error and the next case runs.

    python benchmarks/torch_peer_lora.py --device cuda --steps 3 \
        --case '{"name": "llama3-8b", "vocab": 128256, "hidden": 4096, ...}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_case(
    case: dict[str, Any], device: str, steps: int, rank: int
) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=case["vocab"],
        hidden_size=case["hidden"],
        intermediate_size=case["intermediate"],
        num_hidden_layers=case["layers"],
        num_attention_heads=case["heads"],
        num_key_value_heads=case["kv_heads"],
        max_position_embeddings=max(8192, case["seq"]),
        rms_norm_eps=1e-5,
        rope_theta=case["rope_theta"],
        tie_word_embeddings=case["tied"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # weights made in bfloat16
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(before)
    lcfg = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS
    )
    model = get_peft_model(model, lcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (case["batch"], case["seq"]), device=device)
    times, loss = [], float("nan")
    for i in range(steps + 2):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.loss)  # waits for the step
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    result = {
        "name": case["name"],
        "batch": case["batch"],
        "seq": case["seq"],
        "torch": torch.__version__,
        "step_s": round(step, 4),
        "tokens_per_s": round(case["batch"] * case["seq"] / step, 1),
        "loss": round(loss, 4),
        "peak_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
    }
    del model, opt, params, out
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--case", action="append", default=[], help="a JSON shape")
    a = ap.parse_args()
    for text in a.case:
        case = json.loads(text)
        try:
            result = run_case(case, a.device, a.steps, a.rank)
        except Exception as e:
            result = {"name": case["name"], "batch": case["batch"], "seq": case["seq"],
                      "error": f"{type(e).__name__}: {str(e)[:300]}"}  # fmt: skip
            try:
                import torch

                torch.cuda.empty_cache()
            except Exception:
                pass
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
