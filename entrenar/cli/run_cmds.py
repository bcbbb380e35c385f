"""``entrenar train``, ``entrenar eval`` and ``entrenar plot``."""

from __future__ import annotations

import json
import os
from typing import Any

import click

from entrenar.cli.app import ModelPath, command, is_verbose, parse_sets
from entrenar.cli.decode_cmds import weight_options


def _overrides(**flags: Any) -> dict[str, Any]:
    """Command-line flags as dotted config overrides (only the ones given)."""
    keys = {
        "epochs": "training.epochs",
        "max_steps": "training.max_steps",
        "lr": "optimizer.lr",
        "batch_size": "data.batch_size",
        "output_dir": "training.output_dir",
        "seed": "training.seed",
        "save_every": "training.checkpoint_every",
        "log_every": "training.log_every",
        "grad_accum": "training.grad_accum",
    }
    out = {keys[k]: v for k, v in flags.items() if v is not None}
    if flags.get("epochs") is not None and flags.get("max_steps") is None:
        out["training.max_steps"] = None  # --epochs sets the length of the run
    return out


@command("train")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    help="Override training.epochs (and drop training.max_steps).",
)
@click.option(
    "--max-steps", type=click.IntRange(min=1), help="Override training.max_steps."
)
@click.option("--lr", type=float, help="Override optimizer.lr.")
@click.option(
    "--batch-size", type=click.IntRange(min=1), help="Override data.batch_size."
)
@click.option(
    "--grad-accum", type=click.IntRange(min=1), help="Override training.grad_accum."
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False),
    help="Override training.output_dir.",
)
@click.option("--seed", type=click.IntRange(min=0), help="Override training.seed.")
@click.option(
    "--save-every",
    type=click.IntRange(min=1),
    help="Override training.checkpoint_every.",
)
@click.option(
    "--log-every", type=click.IntRange(min=1), help="Override training.log_every."
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any key, e.g. --set lora.rank=16 (VALUE is read as YAML).",
)
@click.option(
    "--resume",
    metavar="latest|PATH",
    help="Continue from the newest checkpoint in the output dir ('latest') or from "
    "a run folder / checkpoint folder.",
)
@click.option(
    "--dry-run", is_flag=True, help="Build model, data and optimizer; do not train."
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def train_cmd(
    config: str,
    sets: tuple[str, ...],
    resume: str | None,
    dry_run: bool,
    no_progress: bool,
    **flags: Any,
) -> None:
    """Train the run CONFIG describes (a YAML file; see specs/config.md)."""
    from entrenar.runs.run import train_from_yaml

    overrides = _overrides(**flags) | parse_sets(sets)
    result = train_from_yaml(
        config,
        overrides,
        resume=resume,
        dry_run=dry_run,
        progress=not no_progress,
    )
    if dry_run:
        click.echo(f"✓ dry run: {config} builds; nothing was trained")
        for k, v in result.metrics.items():
            click.echo(f"  {k}: {v}")
        return
    if result.spec.is_merge:
        click.echo(f"✓ merged: {result.files['merged']}")
        for kind, path in result.files.items():
            if kind != "merged":
                click.echo(f"  {kind}: {path}")
        return
    m = result.metrics
    parts = [
        f"{k}={_fmt(m[k])}" for k in ("steps", "train_loss", "eval_loss") if k in m
    ]
    click.echo(f"✓ trained: {', '.join(parts)}")
    for kind, path in result.files.items():
        click.echo(f"  {kind}: {path}")
    if is_verbose():
        click.echo(json.dumps(m, indent=2, default=str))


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


DATA_FORMATS = ("auto", "text", "prompt_completion", "chat")


@command("eval")
@click.argument("target", type=ModelPath())
@click.option(
    "--data",
    "data_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Data to evaluate on (default: the config's validation data).",
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True),
    help="With a CONFIG: the trained model to evaluate (default: "
    "the run's model.safetensors, model.gguf, hf/ or model.json, else its base "
    "with its adapter/).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice([*DATA_FORMATS, "json"]),
    default="auto",
    show_default=True,
    help="A language model's data format: chat gives the exact match of greedy "
    "replies and the loss on the replies (auto: from the first record's fields). "
    "'json' is the old spelling of --json.",
)
@click.option(
    "--compare",
    "base",
    type=ModelPath(),
    help="A base MODEL to evaluate on the same data: both printed side by side "
    "(before and after a fine-tune).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@click.option(
    "--generate",
    is_flag=True,
    help="Chat data: score the exact match by decoding the replies (batched) "
    "instead of one teacher-forced pass.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Conversations per forward pass, or replies decoded at once.",
)
@weight_options
def eval_cmd(
    target: str,
    data_path: str | None,
    model_path: str | None,
    fmt: str,
    base: str | None,
    as_json: bool,
    generate: bool,
    batch_size: int,
    keep_quantized: bool,
    decode_activations: str | None,
) -> None:
    """Evaluate a trained model: TARGET is a run's CONFIG or a MODEL file.

    With a MODEL, --data names the data: tabular for an mlp (the model file stores
    its features, target and normalisation), text, prompt-completion or chat for a
    language model. Progress goes to stderr.
    """
    from entrenar.cli.inspect import CONFIG_EXTENSIONS, is_model_yaml
    from entrenar.runs import evaluate

    as_json, fmt = as_json or fmt == "json", "auto" if fmt == "json" else fmt
    weights = keep_quantized or decode_activations is not None
    log = None if as_json else (lambda line: click.echo(line, err=True))
    if target.lower().endswith(CONFIG_EXTENSIONS) and not is_model_yaml(target):
        if base is not None or generate or weights:
            raise click.UsageError(
                "--compare, --generate, --keep-quantized and --decode-activations "
                "take a MODEL and --data, not a CONFIG"
            )
        out = evaluate.evaluate_config(target, data=data_path, model=model_path)
    elif data_path is None:
        raise click.UsageError("evaluating a MODEL needs --data FILE")
    elif base is not None:
        if generate or weights:
            raise click.UsageError(
                "--generate, --keep-quantized and --decode-activations do not "
                "combine with --compare"
            )
        both = evaluate.compare_models(base, target, data_path, fmt=fmt, log=log)
        _print_side_by_side(both, as_json)
        return
    else:
        out = evaluate.evaluate_model(
            target, data_path, fmt=fmt, log=log, generate=generate,
            batch_size=batch_size, keep_quantized=keep_quantized,
            decode_activations=decode_activations,
        )  # fmt: skip
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            click.echo(f"{k}: {_fmt(v)}")


def _print_side_by_side(both: dict[str, dict[str, Any]], as_json: bool) -> None:
    """``metric  base  model`` rows (or the JSON of both)."""
    if as_json:
        click.echo(json.dumps(both, indent=2))
        return
    base, model = both["base"], both["model"]
    keys = [*base, *(k for k in model if k not in base)]
    rows = [("metric", "base", "model")]
    rows += [(k, _fmt(base.get(k, "-")), _fmt(model.get(k, "-"))) for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        click.echo(
            f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}".rstrip()
        )


@command("plot")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Image path (default RUN_DIR/loss.png).",
)
def plot_cmd(run_dir: str, output: str | None) -> None:
    """Plot RUN_DIR/metrics.jsonl: train and eval loss and the learning rate."""
    from entrenar.train.plot import plot

    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        raise click.BadParameter(
            f"{run_dir} has no metrics.jsonl", param_hint="RUN_DIR"
        )
    click.echo(plot(run_dir, output))


__all__ = ["eval_cmd", "parse_sets", "plot_cmd", "train_cmd"]
