"""``entrenar quantize`` and ``entrenar merge``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from entrenar.cli.app import ModelPath, command

if TYPE_CHECKING:
    from entrenar.merge import Recipe

SCHEMES = ("nf4", "int4", "int8", "q4_0", "q4_1", "q8_0")
MERGE_METHODS = (
    "ties",
    "dare_ties",
    "dare_linear",
    "task_arithmetic",
    "linear",
    "average",
    "dare",
    "slerp",
)
"""``--method`` choices: the recipe's `merge_method` names and two spellings of the
book's CLI, ``average`` (linear) and ``dare`` (dare_linear: drop and rescale, then
the weighted sum, without TIES's sign election)."""
ALIASES = {"average": "linear", "dare": "dare_linear"}


def _scheme(scheme: str | None, bits: int | None, method: str | None) -> str:
    """The scheme from --scheme, or from the book's --bits / --method."""
    if scheme is not None:
        if bits is not None and bits != (8 if scheme in ("int8", "q8_0") else 4):
            raise click.BadParameter(
                f"--bits {bits} contradicts --scheme {scheme}", param_hint="--bits"
            )
        return scheme
    if bits == 8:
        return "int8" if method == "asymmetric" else "q8_0"
    return "q4_1" if method == "asymmetric" else "q4_0"


@command("quantize")
@click.argument("model", type=ModelPath())
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False),
    help="Output file: .gguf (a Llama in q8_0/q4_0/q4_1), .safetensors or .json.",
)
@click.option(
    "--scheme",
    type=click.Choice(SCHEMES),
    help="Quantization scheme (default: q4_0, or q8_0 with --bits 8).",
)
@click.option(
    "--bits",
    type=click.Choice(["4", "8"]),
    default=None,
    help="4 or 8 bits, when --scheme is not given.",
)
@click.option(
    "--method",
    type=click.Choice(["symmetric", "asymmetric"]),
    help="With --bits: symmetric (q4_0 / q8_0) or asymmetric (q4_1 / int8 "
    "with zero points).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=2),
    default=64,
    show_default=True,
    help="Values per block (nf4, int4, int8).",
)
@click.option("--per-channel", is_flag=True, help="int8: one scale per output row.")
@click.option(
    "--calibration-data",
    type=click.Path(exists=True, dir_okay=False),
    help="Data to compare the quantized model with the original on "
    "(loss, accuracy or perplexity, before and after; progress on stderr).",
)
def quantize_cmd(
    model: str,
    output: str,
    scheme: str | None,
    bits: str | None,
    method: str | None,
    block_size: int,
    per_channel: bool,
    calibration_data: str | None,
) -> None:
    """Quantize MODEL's weights and write them to OUTPUT."""
    from entrenar.runs.quantize import quantize_file

    chosen = _scheme(scheme, int(bits) if bits else None, method)
    if per_channel and chosen != "int8":
        if scheme is None and bits is None:
            chosen = "int8"
        else:
            raise click.BadParameter(
                "only int8 has per-channel scales", param_hint="--per-channel"
            )
    report = quantize_file(
        model,
        output,
        chosen,
        block_size=block_size,
        per_channel=per_channel,
        symmetric=method != "asymmetric",
        calibration_data=calibration_data,
        log=lambda line: click.echo(line, err=True),
    )
    click.echo(f"✓ {model} -> {output} ({chosen})")
    for k, v in report.items():
        click.echo(f"  {k}: {v}")


def _floats(text: str | None, name: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of numbers", param_hint=name
        ) from None


@command("merge")
@click.argument("models", nargs=-1, type=ModelPath())
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="Output file (.safetensors, .gguf, .json) or folder.",
)
@click.option(
    "--config",
    "recipe",
    type=click.Path(exists=True, dir_okay=False),
    help="A mergekit-shaped recipe, or a run config with a merge: section.",
)
@click.option(
    "--method",
    type=click.Choice(MERGE_METHODS),
    default="ties",
    show_default=True,
    help="Merge method (average = linear, dare = dare_linear).",
)
@click.option(
    "--base",
    type=click.Path(exists=True),
    help="Base model (task vectors are taken against it; SLERP's t=0 end).",
)
@click.option("--weights", help="Comma-separated weight per model.")
@click.option(
    "--density",
    type=click.FloatRange(0, 1, min_open=True),
    help="TIES/DARE: fraction of each task vector kept.",
)
@click.option(
    "--weight",
    "--t",
    "t",
    type=click.FloatRange(0, 1),
    help="SLERP: interpolation factor t.",
)
@click.option("--lambda", "lam", type=float, help="Scale of the merged task vector.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    help="Compute and output dtype.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="DARE's seed.")
@click.option(
    "--quantized",
    type=click.Choice(["correct", "refuse", "keep"]),
    default="correct",
    show_default=True,
    help="A task vector that is mostly the noise of re-quantizing the base onto a "
    "quantized file's grid: correct it, refuse the merge, or keep it.",
)
@click.option(
    "--eval",
    "evals",
    multiple=True,
    metavar="TASK=FILE",
    help="Score the merged model on a held-out chat JSONL (exact match of greedy "
    "replies); repeat for each task.",
)
@click.option(
    "--search",
    is_flag=True,
    help="With --eval: try a small grid of the method's settings (density, λ, "
    "weights, t) and keep the best worst-task score.",
)
def merge_cmd(
    models: tuple[str, ...],
    output: str | None,
    recipe: str | None,
    method: str,
    base: str | None,
    weights: str | None,
    density: float | None,
    t: float | None,
    lam: float | None,
    dtype: str | None,
    seed: int,
    quantized: str,
    evals: tuple[str, ...],
    search: bool,
) -> None:
    """Merge MODELS (or the recipe given with --config) into one model."""
    import warnings

    from entrenar import merge
    from entrenar.merge.run import files_recipe

    tasks = _eval_tasks(evals)
    if search and not tasks:
        raise click.UsageError("--search scores merges on held-out sets: add --eval")
    if recipe is not None:
        if models:
            raise click.UsageError("give MODELS or --config RECIPE, not both")
        if tasks:
            raise click.UsageError("--eval and --search take MODELS, not --config")
        written = _merge_recipe(recipe, output)
        click.echo(f"✓ merged ({recipe}) -> {written}")
        return
    if output is None:
        raise click.UsageError("missing -o/--output")
    method = ALIASES.get(method, method)
    if method == "slerp":
        if len(models) == 2 and base is None:
            base, models = models[0], models[1:]
        if t is None and not search:
            raise click.UsageError("slerp needs --weight/--t")
    elif method not in ("linear",) and base is None:
        if len(models) < 2:
            raise click.UsageError(f"{method} needs --base or at least two MODELS")
        base, models = models[0], models[1:]
    if not models:
        raise click.UsageError("name at least one model to merge")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        plan = files_recipe(
            list(models),
            method,
            base=base,
            weights=_floats(weights, "--weights"),
            density=density,
            t=0.5 if method == "slerp" and t is None else t,
            lam=lam,
            dtype=dtype,
            seed=seed,
            quantized=quantized,
        )
        if tasks:
            _scored_merge(plan, tasks, base or models[0], search, output)
        else:
            merge.run_recipe(plan, output)
    for message in dict.fromkeys(str(w.message) for w in caught):  # once each
        click.echo(f"! {message}", err=True)
    onto = f" onto base {base}" if base is not None else ""
    count = f"{len(models)} model{'s' if len(models) != 1 else ''}"
    click.echo(f"✓ merged {count}{onto} ({method}) -> {output}")


def _eval_tasks(evals: tuple[str, ...]) -> dict[str, str]:
    """``{task: file}`` of the --eval options."""
    tasks = {}
    for e in evals:
        name, sep, path = e.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{e!r}: expected TASK=FILE", param_hint="--eval")
        if not os.path.isfile(path):
            raise click.BadParameter(f"{path}: no such file", param_hint="--eval")
        tasks[name] = path
    return tasks


def _scored_merge(
    recipe: Recipe, tasks: dict[str, str], model_file: str, search: bool, output: str
) -> None:
    """Merge (searching the grid with --search), write the best, print the scores."""
    from entrenar import merge
    from entrenar.merge.search import format_table
    from entrenar.runs.merging import chat_scorer, search_merge

    score = chat_scorer(model_file, tasks)
    if search:
        result = search_merge(recipe, score, output=output)  # writes the best
        click.echo(result.table())
        best = result.best
        shown = ", ".join(f"{k}={v}" for k, v in best.setting.items())
        click.echo(f"best worst-task score {best.worst:.3f} with {shown}")
        return
    model = merge.run_recipe(recipe, output)
    click.echo(format_table([merge.Trial({}, score(model))]))


def _merge_recipe(path: str, output: str | None) -> str:
    from entrenar import merge
    from entrenar.config.summary import validate
    from entrenar.runs.merging import is_bare_recipe, load_recipe_file, run_merge

    if is_bare_recipe(path):
        if output is None:
            raise click.UsageError("a bare recipe needs -o/--output")
        merge.run_recipe(load_recipe_file(path), output)
        return output
    overrides = {}
    if output is not None:
        overrides["training.output_dir"] = os.path.dirname(output) or "."
    spec = validate(path, overrides)
    if not spec.is_merge:
        raise click.UsageError(f"{path} has no merge: section")
    files = run_merge(spec)
    if output is not None and files["merged"] != os.path.abspath(output):
        os.replace(files["merged"], output)
        return output
    return files["merged"]


__all__ = ["merge_cmd", "quantize_cmd"]
