"""The `entrenar` command, with hooks that let test_cli_kill_resume.py kill it.

Usage: ``python killable_cli.py train CONFIG [options]`` (the arguments of
``entrenar``). The command runs unchanged; the hooks only announce where it is, on
stdout and flushed, so that the parent can SIGKILL it at a chosen point:

- ``STEP n`` after each optimizer step (its metrics computed; a GRPO step too);
- ``HANG_AT_CHECKPOINT=n``: checkpoint ``n`` is written completely but orbax stops
  before its final rename, prints ``HANG`` and sleeps (a kill mid-write);
- ``HANG_AT_CHECKSUMS=n``: checkpoint ``n`` renamed in, its ``checksums.json`` not
  yet written: prints ``HANG`` and sleeps;
- ``HANG_IN_EXPORT=kind``: the export of ``kind`` (``adapter``, ``safetensors``,
  ``gguf``, ``hf``, ``quantized``) has written half of its first file: prints
  ``HANG`` and sleeps.
"""

import os
import sys
import time
import types

import jax


def announce_steps():
    from entrenar.train import Trainer

    original = Trainer.train_step

    def train_step(self, batch):
        metrics = original(self, batch)
        jax.block_until_ready(metrics)
        print(f"STEP {self.step}", flush=True)
        return metrics

    Trainer.train_step = train_step

    from entrenar.preference import grpo_run

    grpo_step = grpo_run.GRPO.step

    def step(self, records, index):
        metrics = grpo_step(self, records, index)
        jax.block_until_ready(self.state)
        print(f"STEP {index + 1}", flush=True)
        return metrics

    grpo_run.GRPO.step = step


def hang():
    print("HANG", flush=True)
    time.sleep(600)
    raise SystemExit(3)


def hang_before_rename(step):
    """Make orbax stop, forever, just before it renames checkpoint ``step`` in."""
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        if self._final_path.name == str(step):
            hang()
        return await original(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def hang_before_checksums(step):
    """Stop after orbax's rename of checkpoint ``step``, before its checksums."""
    from entrenar.train import checkpoint

    original = checkpoint.write_checksums

    def write_checksums(folder, *args, **kwargs):
        if os.path.basename(os.path.normpath(folder)) == str(step):
            hang()
        return original(folder, *args, **kwargs)

    checkpoint.write_checksums = write_checksums


def hang_in_export(kind):
    """Hang in ``kind``'s export, its first file written but not yet renamed in.

    ``kind``: adapter, safetensors, gguf, hf or quantized. The hook stops at the
    writer's first ``os.replace`` (an `atomic_write` about to put a complete
    temporary file in place), or, for a writer without one, when it returns.
    """
    from entrenar.runs import export

    names = {
        "adapter": ("lora", "save_adapter"),
        "safetensors": (None, "save_built"),
        "gguf": ("lora", "save_folded_gguf"),
        "hf": (None, "write_hf_folder"),
        "quantized": (None, "write_quantized"),
    }
    owner_name, fn_name = names[kind]
    owner = getattr(export, owner_name) if owner_name else export
    original = getattr(owner, fn_name)

    def patched(*args, **kwargs):
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            hang()

        os.replace = replace
        try:
            original(*args, **kwargs)
        finally:
            os.replace = real_replace
        hang()

    if owner_name:  # a module export.py reaches as an attribute (lora)
        proxy = types.ModuleType(owner.__name__)
        proxy.__dict__.update(owner.__dict__)
        setattr(proxy, fn_name, patched)
        setattr(export, owner_name, proxy)
    else:
        setattr(export, fn_name, patched)


if __name__ == "__main__":
    announce_steps()
    if os.environ.get("HANG_AT_CHECKPOINT"):
        hang_before_rename(int(os.environ["HANG_AT_CHECKPOINT"]))
    if os.environ.get("HANG_AT_CHECKSUMS"):
        hang_before_checksums(int(os.environ["HANG_AT_CHECKSUMS"]))
    if os.environ.get("HANG_IN_EXPORT"):
        hang_in_export(os.environ["HANG_IN_EXPORT"])
    from entrenar.cli import main

    sys.argv[0] = "entrenar"
    main()
