# ruff: noqa: E501  (markdown table rows are one line each)
"""specs/config.md, generated from the schema: ``python -m entrenar.config.docs``.

The reference tables come from the `option` declarations of each section (type,
default, range, aliases, meaning), so the document cannot drift from the code; a
test regenerates it and compares.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any

from entrenar import nn
from entrenar.config.spec import NAMED_MODELS, TrainSpec
from entrenar.schema import MISSING, describe_fields, hints, type_name


def sections() -> list[tuple[str, type]]:
    """``(key, class)`` of the top level and of each section, in the file's order."""
    out: list[tuple[str, type]] = [("(top level)", TrainSpec)]
    for f in dataclasses.fields(TrainSpec):
        hint = hints(TrainSpec)[f.name]
        for cls in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(cls):
                out.append((f.name, cls))  # type: ignore[arg-type]
    return out


INTRO = """\
# Run configuration (YAML)

One YAML file describes a run; `entrenar train FILE` (or
`entrenar.runs.train_from_yaml(FILE, overrides)`) runs it, `entrenar validate FILE`
checks it without running. This page is generated from the config class of each
section, named in its heading (`python -m entrenar.config.docs > specs/config.md`);
a test keeps it in step.

## Reading rules

- The file is read with `yaml.safe_load` within the limits of
  specs/conventions.md (at most 1 MiB, nesting 100 deep, aliases standing for at
  most 10,000 nodes in all, UTF-8, each key once per mapping), so a hostile file is
  a `ConfigError` at once.
  Every key is checked: an unknown key, a
  value of the wrong type, a number out of range or a missing input file is a
  `ConfigError` whose message starts with the key path, e.g.
  `optimizer.lr: must be > 0, got -1` or
  `training.epochz: unknown key; did you mean 'epochs'?` (closest key by `difflib`).
- Aliases (the book's and Hugging Face's spellings: `save_interval`,
  `target_modules`, `max_grad_norm`, ...) are accepted; giving a key and its alias
  both is an error.
- Numbers: YAML 1.1 reads `1e-4` as a string; number fields accept such strings.
  Integer fields accept whole floats (`3.0`), never booleans.
- Paths: input files (`model.path`, `model.tokenizer`, `data.train`,
  `data.validation`, `distillation.teacher`, merge models) are relative to the
  config file's folder; `~` and `$VARIABLES` are expanded. `training.output_dir` is
  relative to the working directory. `model.path` may also be a named model:
  NAMED_MODELS.
- Overrides: `load_config(path, {"training.max_steps": 5})`, or on the command
  line `--epochs/--max-steps/--lr/--batch-size/--grad-accum/--output-dir/--seed/
  --save-every/--log-every` and `--set KEY=VALUE` for any key (VALUE read as YAML;
  `null` removes the key so its default applies). `--epochs` also drops
  `training.max_steps`, so the run has the asked length.
- A training run needs `model` and `data`; a file with a `merge` recipe (and no
  `data`) is a merge. Sections left out take their defaults (`optimizer`,
  `training`, `export`) or are off (`scheduler`, `lora`, `quantization`,
  `distillation`).

## Example

```yaml
model:
  path: smollm2                 # or a .gguf / .safetensors / HF folder
  keep_quantized: true
data:
  train: data/train.jsonl
  format: chat
  batch_size: 8
  seq_len: 128
lora: {rank: 16, alpha: 32, targets: [q_proj, v_proj], quantize_base: nf4}
optimizer: {name: adamw, lr: 2e-3}
scheduler: {name: warmup_cosine_decay, warmup_steps: 10}
training: {max_steps: 100, checkpoint_every: 50, output_dir: runs/demo}
export: {formats: [adapter, gguf], gguf_type: Q8_0}
```
"""

OUTRO = """\
## Architectures built from scratch (`model.config`)

`model.architecture` with `model.config` builds a model from scratch; the keys of
`model.config` are the fields of the architecture's config class (checked the same
way: unknown keys get the closest field). Defaults are the class's.

ARCH_TABLES

## What a run writes (`training.output_dir`)

| file | what |
| --- | --- |
| `config.json` | the validated config, defaults filled in |
| `metrics.jsonl` | one JSON line per log step and per evaluation (`entrenar.train`) |
| `tensorboard/` | the same metrics as TensorBoard events (`training.tensorboard: true`) |
| `checkpoints/<step>/` | resumable train states (`--resume latest` or a path) |
| `model.safetensors`, `model.json` | the trained model (LoRA adapters folded in); its metadata holds the architecture (`custom.model_config` or `custom.llama_config`), a language model's tokenizer (`custom.tokenizer`: `model.tokenizer`, else the GGUF or Hugging Face folder it was read from, relative to the file) and, for tabular data, the feature columns, target and normalisation (`custom.tabular`) |
| `model.gguf` | a Llama-style decoder (llama, mistral, qwen2/3, gemma2/3, phi3) as llama.cpp reads it, under its family's GGUF architecture, matrices in `export.gguf_type`; a config the writer would refuse (no llama.cpp form, a layout llama.cpp computes otherwise, rows not whole blocks of the type, an expert type the model cannot take: `io.check_llama_gguf`) is refused before training, and by `validate`, with the writer's message (`runs.export.check_gguf_export`), as is a GGUF `quantization` copy |
| `hf/` | a Hugging Face folder of the model's family (`config.json` naming its class, e.g. `LlamaForCausalLM`, `Qwen2ForCausalLM`; `model.safetensors`; `generation_config.json`; with a tokenizer, `tokenizer.json` and `tokenizer_config.json` with the chat template) |
| `adapter/` | the LoRA adapter in PEFT's layout |
| `model-<scheme>.<ext>` | the `quantization` copy: a llama.cpp GGUF for a Llama-style decoder in q8_0/q4_0/q4_1, else an entrenar model file whose quantized weights are stored as their arrays (`<name>.codes`, `<name>.scales`, `<name>.offsets`, ...) with `custom.quantization[<name>] = {scheme, block_size, dtype, granularity}` |
| `loss.png` | train/eval loss and learning rate (with matplotlib) |
| `result.json` | final metrics and the files written |

A merge writes `model.<format>` for each model format of `export.formats`; a merge
of Hugging Face folders writes the folder `hf/` (`export.formats: [hf]`, its only
format: a model file would keep the folders' tensor names and no architecture).

## Merge recipes (`merge`)

The `merge` section is a mergekit-shaped recipe, validated by
`entrenar.merge.parse_recipe` (specs/merging.md): `merge_method` (linear,
task_arithmetic, ties, dare_linear, dare_ties, slerp), `base_model`, `models` (each
`model` and its `parameters`: `weight`, `density`), global `parameters` (`normalize`,
`lambda`, `t`, ...), `dtype`, `out_dtype`, `random_seed`. Model paths are relative
to the config file; each must exist. `entrenar merge --config FILE` runs a config's
recipe or a bare recipe file.

## The `entrenar` command

`entrenar train | validate | info | quantize | merge | generate | chat | eval | plot`;
`entrenar COMMAND --help` lists each one's options. Three of them in more words:

- `validate CONFIG [--sample N] [--set KEY=VALUE]` checks what `train` would refuse
  (with the same `--set` overrides), in seconds
  (`entrenar.runs.preflight`), without loading weights: keys, values and files; the
  model file's header (a GGUF's magic, version, metadata and tensor table; a Hugging
  Face folder's `config.json` and safetensors headers) and the tokenizer; the `lora`
  targets and QLoRA bases, a distillation teacher and a GGUF export the writer would
  refuse (`runs.export.check_gguf_export`), on those headers; every row of
  every data file parsed and the fields its format reads checked (an invalid JSON line,
  an empty file, a missing field: an error naming file, line and column); `N` evenly
  spaced rows (1000 by default, 0 for all) through the loader `train` builds. It
  prints the adapters' trainable parameters (with `lora`: the real ranks of
  `rank_pattern`, as PEFT counts them), the predicted rows, tokens, tokens cut by
  `seq_len`, tokens with a loss, sequences and steps (`~`: estimated from the
  sample).
- `eval CONFIG` or `eval MODEL --data FILE [--format auto|text|prompt_completion|chat]
  [--compare BASE] [--json]`: loss and accuracy (tabular) or loss and perplexity (text);
  chat data adds the exact match of greedy replies (`entrenar.chat.exact_match`) and its
  loss is the loss on the replies. `--compare BASE` scores BASE on the same rows and
  prints `metric, base, model` side by side (before and after a fine-tune). A CONFIG's
  model is its run's model file (or `--model`), else, when the run wrote only its
  `adapter/`, the base as it trained with the adapter attached.
- `quantize MODEL -o OUT [--calibration-data FILE]`: with calibration data, the
  original and the quantized model are evaluated on it (as `eval` does) after the file
  is written; each stage is printed on stderr, with a progress bar on a terminal.

| exit code | meaning |
| --- | --- |
| 0 | success |
| 1 | the run failed (an error while training, merging or writing) |
| 2 | usage or configuration error: a bad option, an invalid key or value, a missing or unreadable input file, an unsupported request |

An error prints one line, `error: <message>`, on stderr; `--verbose` (before or
after the subcommand) adds the traceback. Shell completion:
`entrenar --completion bash > ~/.entrenar-complete.bash` and `source` it (`zsh`,
`fish` likewise), or `eval "$(_ENTRENAR_COMPLETE=bash_source entrenar)"`.
`python -m entrenar` is the same command.
"""


def _value(v: Any) -> str:
    if v is MISSING:
        return "**required**"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(str(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{}" if not v else str(v)
    if isinstance(v, float):
        return f"{v:g}"
    if dataclasses.is_dataclass(v):
        return "(section)"
    return str(v)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def section_table(cls: type) -> str:
    """The markdown table of one section's keys."""
    rows = [
        "| key | type | default | range | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in describe_fields(cls):
        if cls is TrainSpec and f["name"] == "source":
            continue
        key = f"`{f['name']}`"
        if f["aliases"]:
            key += " (" + ", ".join(f"`{a}`" for a in f["aliases"]) + ")"
        typ = "section" if "section" in f["type"] else f["type"]
        rows.append(
            f"| {key} | {_cell(typ)} | {_cell(_value(f['default']))} | "
            f"{f['range'] or ''} | {_cell(f['doc'])} |"
        )
    return "\n".join(rows)


def arch_tables() -> str:
    """One table per architecture of `model.config`: field, type, default."""
    out = []
    for arch in nn.architectures():
        cls = arch.config_class
        out.append(f"### `{arch.name}` ({cls.__module__}.{cls.__name__})\n")
        out.append("| key | type | default |\n| --- | --- | --- |")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else MISSING
            out.append(
                f"| `{f.name}` | {_cell(type_name(hints(cls)[f.name]))} | "
                f"{_cell(_value(default))} |"
            )
        out.append("")
    return "\n".join(out).rstrip()


def render() -> str:
    """The whole of specs/config.md."""
    parts = [INTRO.replace("NAMED_MODELS", ", ".join(f"`{n}`" for n in NAMED_MODELS))]
    parts.append("## Keys\n")
    for name, cls in sections():
        title = name if name.startswith("(") else f"`{name}`"
        title += f" ({cls.__module__}.{cls.__name__})"
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        parts.append(f"### {title}\n\n{doc}\n\n{section_table(cls)}\n")
    parts.append(OUTRO.replace("ARCH_TABLES", arch_tables()))
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    """Print the document (``python -m entrenar.config.docs > specs/config.md``)."""
    sys.stdout.write(render())


if __name__ == "__main__":
    main()


__all__ = ["arch_tables", "render", "section_table", "sections"]
