"""`quantize_file`: quantize a model file's weights, optionally measured on data.

A llama.cpp GGUF or Hugging Face Llama folder becomes a llama.cpp GGUF (q8_0, q4_0,
q4_1 to a ``.gguf`` path) or an entrenar model file; any `entrenar.io` model file
becomes an entrenar model file with its quantized weights split into their arrays
(`entrenar.runs.export`). With calibration data the original and the quantized
model are evaluated on it (`entrenar.runs.evaluate`), so the cost of the
quantization is a measured number, not a guess.
"""

from __future__ import annotations

import os
from typing import Any

from entrenar import io
from entrenar.io.formats import disk_bytes
from entrenar.io.lock import OutputLock
from entrenar.runs.evaluate import Log, evaluate_built, evaluate_model
from entrenar.runs.export import write_quantized, write_quantized_model
from entrenar.runs.models import BuiltModel, load_built, tokenizer_ref


def _is_llama_file(path: str) -> bool:
    if os.path.isdir(path):
        return True
    if io.detect_format(path) != io.ModelFormat.GGUF:
        return False
    return "entrenar.version" not in io.read_gguf(path).fields


def quantize_file(
    model: str,
    output: str,
    scheme: str,
    *,
    block_size: int = 64,
    per_channel: bool = False,
    symmetric: bool = True,
    calibration_data: str | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """Quantize ``model`` to ``output`` with ``scheme``; a report of what it did.

    ``log`` takes one line per stage (load, quantize, write, each evaluation) and
    turns on the evaluations' progress bars: the calibration runs both models over
    the data after the file is written, which takes minutes for an LLM on a CPU.

    Returns:
        ``{"bytes_before", "bytes_after", "ratio"}`` and, with ``calibration_data``,
        ``"before"`` / ``"after"``: the metrics of both models on it.

    Raises:
        ConfigError: another run is writing ``output`` (`entrenar.io.lock`).
    """
    say = log or (lambda line: None)
    with OutputLock(output, folder=False):  # one writer per output file
        say(f"quantizing {model} to {scheme}")
        built = _quantize(model, output, scheme, block_size, per_channel, symmetric)
        report = _report(model, output)
        say(f"wrote {output} ({report['bytes_after']:,} bytes)")
        if calibration_data is not None:
            say(f"calibration on {calibration_data}: the original, then the quantized")
            report["before"] = (
                evaluate_model(model, calibration_data, log=log)
                if built is None  # the original is loaded once, not twice
                else evaluate_built(built, calibration_data, log=log)
            )
            del built  # one model in memory at a time
            report["after"] = evaluate_model(output, calibration_data, log=log)
    return report


def _quantize(
    model: str,
    output: str,
    scheme: str,
    block_size: int,
    per_channel: bool,
    symmetric: bool,
) -> BuiltModel | None:
    """Write the quantized file; the original as a `BuiltModel` when it was built.

    An entrenar model file written names the original's tokenizer (relative to
    ``output``), so that `load_built` (``entrenar eval``, the calibration) reads it.
    """
    if _is_llama_file(model):
        built = load_built(model)
        name = os.path.splitext(os.path.basename(output))[0]
        tok = built.tokenizer_source
        write_quantized(
            built, built.params, output, scheme, block_size=block_size,
            per_channel=per_channel, name=name,
            extra={"tokenizer": tokenizer_ref(tok, output)} if tok else None,
        )  # fmt: skip
        return built
    source = io.load_model(model)
    source = io.Model(source.metadata.moved(model, output), source.params)
    write_quantized_model(
        source, output, scheme, block_size=block_size,
        per_channel=per_channel, symmetric=symmetric,
    )  # fmt: skip
    return None


def _report(model: str, output: str) -> dict[str, Any]:
    before, after = disk_bytes(model), disk_bytes(output)
    return {
        "bytes_before": before,
        "bytes_after": after,
        "ratio": round(before / after, 2) if after else None,
    }


__all__ = ["quantize_file"]
