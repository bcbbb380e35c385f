"""``entrenar validate`` and ``entrenar info``: what a config or a model file holds."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import click
import numpy as np
import yaml

from entrenar.cli.app import ModelPath, command

CONFIG_EXTENSIONS = (".yaml", ".yml")


@command("validate")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--detailed", is_flag=True, help="Also print what the run will do.")
@click.option(
    "--sample",
    type=click.IntRange(min=0),
    help="Rows of each text data file to tokenize, evenly spaced (default 1000; "
    "0: all). Every row is parsed whatever the sample.",
)
def validate_cmd(config: str, detailed: bool, sample: int | None) -> None:
    """Check CONFIG as `train` would, in seconds, without training.

    Keys, types, ranges and model sizes; the model file's header (not its
    weights) and the tokenizer; every row of the data files parsed and checked,
    a sample tokenized; then the predicted rows, tokens, sequences and steps.
    """
    from entrenar.config import summary
    from entrenar.runs import preflight

    spec = summary.validate(config)
    lines = []
    if not spec.is_merge:
        options = {} if sample is None else {"sample": sample}
        lines = preflight.format_preflight(preflight.preflight(spec, **options))
    click.echo(f"✓ Configuration is valid: {config}")
    for line in lines:
        click.echo(line)
    if detailed:
        for line in summary.format_summary(summary.summarize(spec)):
            click.echo(line)


def plain(x: Any) -> Any:
    """Numpy scalars, tuples and arrays as plain Python data (for JSON and YAML)."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


def _emit(data: dict[str, Any], fmt: str) -> None:
    data = plain(data)
    if fmt == "json":
        click.echo(json.dumps(data, indent=2, default=str))
    elif fmt == "yaml":
        click.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip())
    else:
        _text(data, 0)


def _text(data: Any, depth: int) -> None:
    pad = "  " * depth
    for key, value in data.items():
        if isinstance(value, dict) and value:
            click.echo(f"{pad}{key}:")
            _text(value, depth + 1)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            click.echo(f"{pad}{key}: ({len(value)})")
            for item in value:
                click.echo(
                    f"{pad}  - " + ", ".join(f"{k}={v}" for k, v in item.items())
                )
        else:
            click.echo(f"{pad}{key}: {value}")


@command("info")
@click.argument("path", type=ModelPath(), required=False)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "yaml"]),
    default="text",
    show_default=True,
    help="Output format.",
)
@click.option("--tensors", is_flag=True, help="List every tensor of a model file.")
def info_cmd(path: str | None, fmt: str, tensors: bool) -> None:
    """Describe PATH: a run's YAML config or a model file/folder.

    Without PATH: this machine (versions, backend, devices) and, one line each,
    the native kernels that run, or why one does not; a config adds the kernels
    its ``model.kernels`` policy would run.
    """
    if path is None:
        data = machine_info()
    elif path.lower().endswith(CONFIG_EXTENSIONS) and not is_model_yaml(path):
        from entrenar.config import summary

        spec = summary.validate(path)
        data = {"summary": summary.summarize(spec), "config": summary.as_dict(spec)}
        if spec.model is not None:
            data["kernels"] = kernel_report(spec.model.kernels)
    else:
        data = model_info(path, tensors=tensors)
    _emit(data, fmt)


def machine_info() -> dict[str, Any]:
    """Versions, JAX's backend and devices, and `kernel_report` for this process."""
    import importlib.metadata

    import jax

    from entrenar import native

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
    import logging
    import warnings

    from entrenar import native

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


_MODEL_YAML_LINE = re.compile(
    rb"""^(\{\s*)?["']?format["']?\s*:\s*["']?entrenar\.model["']?\s*([,}#].*)?$"""
)
"""A line that opens an `entrenar.io` model document: top-level ``format:``."""


def is_model_yaml(path: str) -> bool:
    """Whether the YAML file ``path`` is a model `entrenar.io` wrote, not a run config.

    A model document has the top-level key ``format: entrenar.model`` (`save_yaml`
    writes it on the first line, with ``tensors`` and ``metadata``); a run config has
    no top-level ``format``. The file is scanned line by line, unparsed, so a large
    model costs no YAML parse here.
    """
    with open(path, "rb") as f:
        return any(_MODEL_YAML_LINE.match(line.rstrip()) for line in f)


def _tensor_rows(items: list[tuple[str, tuple[int, ...], str]]) -> dict[str, Any]:
    types: dict[str, int] = {}
    for _, shape, kind in items:
        types[kind] = types.get(kind, 0) + math.prod(shape)
    return {
        "tensors": len(items),
        "parameters": sum(math.prod(s) for _, s, _ in items),
        "types": types,
    }


def model_info(path: str, *, tensors: bool = False) -> dict[str, Any]:
    """Format, architecture, parameter count and tensor types of a model file."""
    from entrenar import io

    size = _size(path)
    if os.path.isdir(path):
        from entrenar.runs.models import load_built

        built = load_built(path)
        flat = io.flatten_params(built.params)
        items = [(n, tuple(a.shape), str(a.dtype)) for n, a in flat.items()]
        out: dict[str, Any] = {"path": path, "format": "hf-folder"}
        out["architecture"] = "llama"
    elif io.detect_format(path) == io.ModelFormat.GGUF:
        g = io.read_gguf(path)
        items = [(n, t.shape, t.type_name) for n, t in g.tensors.items()]
        md = g.metadata
        out = {"path": path, "format": "gguf", "gguf_version": g.version}
        out["architecture"] = md.get("general.architecture")
        out["name"] = md.get("general.name")
        arch = out["architecture"]
        for k in ("context_length", "embedding_length", "block_count"):
            if f"{arch}.{k}" in md:
                out[k] = md[f"{arch}.{k}"]
        if "tokenizer.ggml.tokens" in md:
            out["vocab_size"] = len(md["tokenizer.ggml.tokens"])
        if "tokenizer.chat_template" in md:
            out["chat_template"] = True
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
        from entrenar.errors import FormatError

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
    from entrenar import io, quant
    from entrenar.tree import key_path_str

    if not isinstance(quantized, dict):
        flat = io.flatten_params(params)
        return [(n, tuple(a.shape), str(a.dtype)) for n, a in flat.items()]
    import jax

    tree = io.restore_quantized(params, quantized, path)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=quant.is_quantized)[0]
    return [
        (key_path_str(p), tuple(x.shape), x.scheme if quant.is_quantized(x) else
         str(x.dtype))
        for p, x in leaves
    ]  # fmt: skip


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(
            os.path.getsize(os.path.join(root, f))
            for root, _, files in os.walk(path)
            for f in files
        )
    return os.path.getsize(path)


__all__ = ["info_cmd", "is_model_yaml", "model_info", "plain", "validate_cmd"]
