"""What ``entrenar info`` reports: this machine, kernels, a model, a run's memory.

Plain data (dicts of numbers and strings) that the command line prints as text,
JSON or YAML.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import warnings
from typing import Any

import jax

from entrenar import io, native, quant
from entrenar.errors import FormatError
from entrenar.io.formats import disk_bytes
from entrenar.runs.models import read_header
from entrenar.tree import key_path_str


def machine_info() -> dict[str, Any]:
    """Versions, JAX's backend and devices, and `kernel_report` for this process."""
    return {
        "entrenar": importlib.metadata.version("entrenar"),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "kernel_policy": native.current_policy(),
        "kernels": kernel_report(native.current_policy()),
    }


def kernel_report(policy: str) -> dict[str, str]:
    """Each native kernel under ``policy``: ``on``, or ``off: <why>``.

    The reasons are `entrenar.native.reason`'s; kernels are built (once, cached)
    to find out, without the fallback warnings and log lines this report replaces.
    """
    log = logging.getLogger("entrenar.native")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        with native.policy(policy), warnings.catch_warnings():
            warnings.simplefilter("ignore", native.NativeKernelWarning)
            whys = {name: native.reason(name) for name in native.KERNELS}
    finally:
        log.setLevel(level)
    return {name: "on" if why is None else f"off: {why}" for name, why in whys.items()}


def _tensor_rows(items: list[tuple[str, tuple[int, ...], str]]) -> dict[str, Any]:
    """``tensors``, ``parameters`` and the values of each type.

    A Hugging Face MXFP4 pair (gpt-oss's experts: ``*_blocks`` uint8, two values a
    byte, and their ``*_scales``) counts as ``mxfp4`` values, its scales apart
    (``mxfp4_scales``, not parameters).
    """
    types: dict[str, int] = {}
    params = 0
    for name, shape, kind in items:
        n = math.prod(shape)
        if kind == "uint8" and name.endswith("_blocks"):
            kind, n = "mxfp4", 2 * n
        elif kind == "uint8" and name.endswith("_scales"):
            kind, n = "mxfp4_scales", n
        types[kind] = types.get(kind, 0) + n
        params += 0 if kind == "mxfp4_scales" else n
    return {"tensors": len(items), "parameters": params, "types": types}


def _first_line(template: Any) -> str | None:
    """A chat template's first non-empty line (None without a template)."""
    if not isinstance(template, str):
        return None
    lines = [line.strip() for line in template.splitlines() if line.strip()]
    return lines[0][:120] if lines else ""


def _tokenizer_rows(tok: Any) -> dict[str, Any]:
    """``tokenizer`` (kind and size) and ``chat_template`` (first line) of a model."""
    if tok is None:
        return {"tokenizer": None, "chat_template": None}
    kind = "tokenizer.json" if isinstance(tok, io.HFTokenizer) else "gguf"
    return {
        "tokenizer": f"{kind}, {len(tok.tokens)} tokens",
        "chat_template": _first_line(getattr(tok, "chat_template", None)),
    }


def model_info(path: str, *, tensors: bool = False) -> dict[str, Any]:
    """Format, family, size, context, tokenizer and tensor types of a model file.

    A Hugging Face folder and a llama.cpp GGUF are read from their headers (no
    tensor data): the family is the registered one (`entrenar.nn` registry),
    ``context_length`` the model's, ``tokenizer`` its kind and vocabulary size and
    ``chat_template`` the template's first line.
    """
    size = disk_bytes(path)
    if os.path.isdir(path):
        built = read_header(path)
        items = []
        folder = io.read_hf_folder(path)
        for file in folder.files:
            for n, a in io.read_safetensors(file)[0].items():
                items.append((n, tuple(a.shape), str(a.dtype)))
        out: dict[str, Any] = {"path": path, "format": "hf-folder"}
        out["architecture"] = built.architecture
        if folder.skipped_note is not None:  # a vision-language folder
            out["not_loaded"] = folder.skipped_note
        out["context_length"] = built.config.max_position_embeddings
        out |= _tokenizer_rows(built.tokenizer)
    elif io.detect_format(path) == io.ModelFormat.GGUF:
        g = io.read_gguf(path)
        items = [(n, t.shape, t.type_name) for n, t in g.tensors.items()]
        md = g.metadata
        out = {"path": path, "format": "gguf", "gguf_version": g.version}
        out["architecture"] = io.file_architecture(path) or md.get(
            "general.architecture"
        )
        out["name"] = md.get("general.name")
        arch = md.get("general.architecture")
        for k in ("context_length", "embedding_length", "block_count"):
            if f"{arch}.{k}" in md:
                out[k] = md[f"{arch}.{k}"]
        if "tokenizer.ggml.tokens" in md:
            tokens = md["tokenizer.ggml.tokens"]
            if not isinstance(tokens, list):
                raise FormatError(
                    f"{path}: tokenizer.ggml.tokens = {str(tokens)[:40]!r} is not an "
                    "array of strings; the file's tokenizer is damaged"
                )
            out["vocab_size"] = len(tokens)
            model = md.get("tokenizer.ggml.model", "?")
            out["tokenizer"] = f"gguf {model}, {out['vocab_size']} tokens"
        out["chat_template"] = _first_line(md.get("tokenizer.chat_template"))
    else:
        model = io.load_model(path)
        meta = model.metadata
        items = _stored_items(model.params, meta.custom.get("quantization"), path)
        out = {"path": path, "format": io.detect_format(path).value}
        out |= {"name": meta.name, "architecture": meta.architecture}
        out["version"] = meta.version
        if meta.custom.get("model_config"):
            out["model_config"] = meta.custom["model_config"]
        if meta.custom.get("quantization"):
            out["quantization"] = meta.custom["quantization"]
        if meta.custom.get("merge"):
            out["merge"] = meta.custom["merge"]
    if not items:
        raise FormatError(f"{path}: holds no tensors")
    out |= _tensor_rows(items)
    out["file_bytes"] = size
    if tensors:
        out["tensor_list"] = [
            {"name": n, "shape": list(s), "type": k} for n, s, k in items
        ]
    return out


def _stored_items(
    params: Any, quantized: Any, path: str
) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, logical shape, type)`` of each tensor; quantized weights as one."""
    if not isinstance(quantized, dict):
        flat = io.flatten_params(params)
        return [(n, tuple(a.shape), str(a.dtype)) for n, a in flat.items()]
    tree = io.restore_quantized(params, quantized, path)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=quant.is_quantized)[0]
    return [
        (key_path_str(p), tuple(x.shape), x.scheme if quant.is_quantized(x) else
         str(x.dtype))
        for p, x in leaves
    ]  # fmt: skip


def memory_info(spec: Any) -> dict[str, Any]:
    """A run's predicted peak memory (`entrenar.runs.memory_plan.plan_memory`).

    ``{"parts": {name: {"bytes", "what"}}, "load_peak", "train_peak", "peak",
    "max_memory", "fits", "table"}``; ``table`` is the text `format_plan` prints.
    """
    from entrenar.runs.memory_plan import format_plan, plan_memory

    plan = plan_memory(spec)
    return {
        "parts": {n: {"bytes": b, "what": w} for n, b, w in plan.rows()},
        "load_peak": plan.load_peak,
        "train_peak": plan.train_peak,
        "peak": plan.peak,
        "max_memory": plan.budget,
        "fits": plan.fits,
        "table": format_plan(plan),
    }


__all__ = ["kernel_report", "machine_info", "memory_info", "model_info"]
