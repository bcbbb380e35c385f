"""``entrenar validate`` and ``entrenar info``: what a config or a model file holds."""

from __future__ import annotations

import json
import re
from typing import Any

import click
import numpy as np
import yaml

from entrenar.cli.app import ModelPath, command, parse_sets

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
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any key as `train --set` does, e.g. --set model.path=m.gguf.",
)
def validate_cmd(
    config: str, detailed: bool, sample: int | None, sets: tuple[str, ...]
) -> None:
    """Check CONFIG as `train` would, in seconds, without training.

    Keys, types, ranges and model sizes; the model file's header (not its
    weights) and the tokenizer; every row of the data files parsed and checked,
    a sample tokenized; then the predicted rows, tokens, sequences and steps.
    """
    from entrenar.config import summary
    from entrenar.runs import preflight

    spec = summary.validate(config, parse_sets(sets))
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
@click.option(
    "--memory",
    is_flag=True,
    help="A run config's predicted peak memory, part by part (headers only, "
    "nothing loaded; compiles the train step on shapes).",
)
def info_cmd(path: str | None, fmt: str, tensors: bool, memory: bool) -> None:
    """Describe PATH: a run's YAML config or a model file/folder.

    Without PATH: this machine (versions, backend, devices) and, one line each,
    the native kernels that run, or why one does not; a config adds the kernels
    its ``model.kernels`` policy would run. ``--memory CONFIG``: the run's
    predicted peak resident memory (weights, adapters, optimizer state, the
    step's activations and temporaries, the load) against ``training.max_memory``.
    """
    from entrenar.runs import info

    is_config = path is not None and path.lower().endswith(CONFIG_EXTENSIONS)
    is_config = is_config and not is_model_yaml(str(path))
    if memory and not is_config:
        raise click.UsageError("--memory takes a run's YAML config")
    if path is None:
        data = info.machine_info()
    elif is_config:
        from entrenar.config import summary

        spec = summary.validate(path)
        if memory:
            data = info.memory_info(spec)
            if fmt == "text":
                for line in data["table"]:
                    click.echo(line)
                return
            data.pop("table")
        else:
            data = {"summary": summary.summarize(spec)}
            data["config"] = summary.as_dict(spec)
            if spec.model is not None:
                data["kernels"] = info.kernel_report(spec.model.kernels)
    else:
        data = info.model_info(path, tensors=tensors)
    _emit(data, fmt)


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


__all__ = ["info_cmd", "is_model_yaml", "plain", "validate_cmd"]
