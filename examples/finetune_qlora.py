"""QLoRA: fine-tune adapters over a 4-bit NF4 base, compared with LoRA on a float base.

    python examples/finetune_qlora.py [--steps 60] [--out /tmp/entrenar_qlora_adapter]

The model, data and training loop are those of ``finetune_lora.py`` (same folder).
``lora.apply(..., quantize="nf4")`` stores every adapted base as a `QuantizedWeight`
(NF4 codes + double-quantized block scales, ~4.13 bits per value) and the adapters in
float32; the forward pass dequantizes inside the jitted step. At the end the adapters
are merged into dense weights, or merged and requantized with the error reported.
"""

import argparse
import time

import jax
from finetune_lora import MODEL, train

from entrenar import lora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="/tmp/entrenar_qlora_adapter")
    args = parser.parse_args()

    root = jax.random.key(0)
    base = MODEL.init(jax.random.fold_in(root, 0))
    config = lora.LoRAConfig(rank=8, alpha=16.0, targets="all-linear")
    data_key = jax.random.fold_in(root, 2)

    results = {}
    for name, quantize in (
        ("LoRA  (float32 base)", None),
        ("QLoRA (NF4+DQ base)", "nf4"),
    ):
        params = lora.apply(
            base, config, key=jax.random.fold_in(root, 1), quantize=quantize
        )
        report = lora.trainable_report(params)
        print(f"== {name}\n{report}")
        t0 = time.perf_counter()
        params, _, last = train(params, args.steps, key=data_key)
        print(f"final loss {last:.4f} ({time.perf_counter() - t0:.1f} s)")
        results[name] = (params, last, report)

    (_, lora_loss, _), (qparams, q_loss, _) = results.values()
    print(f"QLoRA / LoRA final loss: {q_loss / lora_loss:.4f}")

    _, errors = lora.fold_and_requantize(qparams)
    for path, err in errors.items():
        print(f"requantized {path}: max |err| {err.max_abs:.2e}, "
              f"relative rms {err.relative_rms:.3f}")  # fmt: skip
    lora.save_adapter(qparams, args.out)
    print(f"adapter saved to {args.out} (PEFT layout)")


if __name__ == "__main__":
    main()
