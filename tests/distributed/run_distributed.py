"""Multi-device checks, run in subprocesses (the device count is fixed at jax import).

``python run_distributed.py <check> <out_dir> [args]`` with ``XLA_FLAGS=
--xla_force_host_platform_device_count=N`` set by the caller; each check writes
``<out_dir>/<check>.json`` (and arrays as ``.npz``) for tests/distributed to assert on,
and asserts what it can itself (a failure exits non-zero with the traceback).

- ``meshes`` (8 devices): a small Llama, 20 steps on 1 device and on meshes
  {data: 8}, {fsdp: 8}, {data: 2, fsdp: 4}; loss curves, final params, per-device
  bytes; the {fsdp: 8} run checkpoints at step 10.
- ``resume <meshes_out_dir> <mesh>`` (any device count, started with ``meshes``):
  resume its {fsdp: 8} run at step 10 and train to 20.
- ``adapters`` (8 devices): LoRA on {data: 2, fsdp: 4} and QLoRA (NF4 bases) on
  {fsdp: 8} against 1 device; batch placement helpers.
- ``multiprocess <pid> <port>`` (4 devices each, 2 processes): {data: 2, fsdp: 4}
  over both processes against this process's single-device run.
- ``bf16_copy`` (8 devices): ``matmul_dtype: bfloat16`` LoRA (untied, tied) and
  QLoRA on {fsdp: 8} / {data: 2, fsdp: 4}: the frozen half's bfloat16 copy on
  the mesh against 1 device and against the mesh without the copy; its bytes.
- ``eight <out_dir>`` (8 devices): ``meshes`` then ``adapters`` in one process (one
  jax start-up and one 8-device client instead of two; the tests run this).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from entrenar import distributed, lora, nn
from entrenar.errors import ConfigError
from entrenar.nn import LlamaConfig
from entrenar.optim import adamw, sgd
from entrenar.train import Checkpointer, TrainConfig, Trainer
from entrenar.train.model_loss import loss_for_model
from entrenar.tree import tree_bytes, tree_named_leaves

MODEL = LlamaConfig(
    vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, max_position_embeddings=32,
)  # fmt: skip
ADAPTED = LlamaConfig(  # NF4 blocks of 64 along the input axis
    vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, max_position_embeddings=32, initializer_range=0.3,
)  # fmt: skip
RULES = distributed.ShardingRules(min_size=0)  # tiny model: shard every leaf we can
STEPS, BATCH = 20, 8
TOL = {"rtol": 1e-5, "atol": 1e-5}


def data(vocab: int = 32) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(0).integers(0, vocab, (STEPS * BATCH, 16))
    return {"input_ids": ids.astype(np.int32)}


def config(**kw: object) -> TrainConfig:
    base = {"batch_size": BATCH, "max_steps": STEPS, "log_every": 1, "progress": False}
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def host(tree: object) -> list[np.ndarray]:
    """Every leaf as a numpy array (gathered across processes when needed)."""
    from jax.experimental import multihost_utils

    out = []
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = multihost_utils.process_allgather(x, tiled=True)
        out.append(np.asarray(x))
    return out


def fit(model: LlamaConfig, params: object, mesh: object, **kw: object) -> dict:
    trainable = kw.pop("trainable", None)
    resume = kw.pop("resume", None)
    t = Trainer(model, params, adamw(1e-3), config(**kw), mesh=mesh,
                sharding_rules=RULES, trainable=trainable)  # fmt: skip
    r = t.fit(data(model.vocab_size), resume=resume)
    return {"loss": [h["loss"] for h in r.history], "state": r.state,
            "params": host(r.state.trainable), "trainer": t}  # fmt: skip


def same(run: dict, ref: dict, what: str) -> None:
    np.testing.assert_allclose(run["loss"], ref["loss"], **TOL, err_msg=what)
    for a, b in zip(run["params"], ref["params"], strict=True):
        np.testing.assert_allclose(a, b, **TOL, err_msg=what)


def meshes(out: str) -> None:
    params = MODEL.init(jax.random.key(0))
    ref = fit(MODEL, params, None)
    moved = max(
        float(np.max(np.abs(a - np.asarray(b))))
        for a, b in zip(ref["params"], jax.tree_util.tree_leaves(params))
    )
    assert moved > 1e-3, moved  # the runs train: matching is not trivial
    report: dict = {"loss": ref["loss"], "moved": moved, "bytes": {}}
    np.savez(os.path.join(out, "final.tmp.npz"), *ref["params"])  # for `resume`
    os.replace(os.path.join(out, "final.tmp.npz"), os.path.join(out, "final.npz"))
    for name, spec, kw in (
        ("data8", {"data": 8}, {}),
        ("fsdp8", {"fsdp": 8}, {"output_dir": out, "checkpoint_every": 10}),
        ("data2_fsdp4", {"data": 2, "fsdp": 4}, {}),
    ):
        run = fit(MODEL, params, spec, **kw)
        same(run, ref, name)
        state = run["state"]
        per_device = distributed.bytes_per_device((state.trainable, state.opt_state))
        report["bytes"][name] = {
            "total": tree_bytes((state.trainable, state.opt_state)),
            "max_per_device": max(per_device.values()),
            "devices": len(per_device),
        }
    with open(os.path.join(out, "meshes.json"), "w") as f:
        json.dump(report, f)


def resume(out: str, ckpt: str, spec: str) -> None:
    # started with `meshes`: wait for its reference params and step-10 checkpoint
    # (orbax renames a checkpoint's folder when complete), then copy the
    # checkpoint, so that our Checkpointer never touches the running one's folder
    src = os.path.join(ckpt, "checkpoints", "10")
    deadline = time.monotonic() + 900
    while not (os.path.isdir(src) and os.path.exists(os.path.join(ckpt, "final.npz"))):
        assert time.monotonic() < deadline, f"no checkpoint {src}"
        time.sleep(0.5)
    shutil.copytree(src, os.path.join(out, "checkpoints", "10"))
    mesh = json.loads(spec)
    params = MODEL.init(jax.random.key(0))
    run = fit(MODEL, params, mesh, resume=os.path.join(out, "checkpoints", "10"))
    ref = np.load(os.path.join(ckpt, "final.npz"))
    for i, a in enumerate(run["params"]):
        np.testing.assert_allclose(a, ref[f"arr_{i}"], **TOL)
    layout = {str(x.sharding) for x in jax.tree_util.tree_leaves(run["state"])}
    with open(os.path.join(out, "resume.json"), "w") as f:
        json.dump({"devices": jax.device_count(), "steps": int(run["state"].step),
                   "shardings": sorted(layout)}, f)  # fmt: skip


def adapters(out: str) -> None:
    base = ADAPTED.init(jax.random.key(0))
    cfg = lora.LoRAConfig(rank=4, alpha=8, targets=lora.ALL_LINEAR, dropout=0.1)
    report = {}
    for name, quantize, spec in (
        ("lora", None, {"data": 2, "fsdp": 4}),
        ("qlora", "nf4", {"fsdp": 8}),
    ):
        params = lora.apply(base, cfg, key=jax.random.key(1), quantize=quantize)
        ref = fit(ADAPTED, params, None, trainable="lora")
        run = fit(ADAPTED, params, spec, trainable="lora")
        same(run, ref, name)
        frozen = jax.tree_util.tree_leaves(run["state"].frozen)
        report[name] = {
            "loss": run["loss"],
            # each PartitionSpec as the tuple of its axes (its repr differs
            # between JAX versions: "P()" / "PartitionSpec()")
            "frozen_specs": sorted({str(tuple(x.sharding.spec)) for x in frozen}),
            "trainable_specs": sorted(
                {str(tuple(x.sharding.spec))
                 for x in jax.tree_util.tree_leaves(run["state"].trainable)}
            ),
        }  # fmt: skip
    mesh = distributed.make_mesh({"data": 2, "fsdp": 4})
    try:
        distributed.shard_batch({"input_ids": np.zeros((6, 4), np.int32)}, mesh)
        report["batch_error"] = None
    except distributed.batch.ShapeError as e:
        report["batch_error"] = str(e)
    b = distributed.shard_batch({"x": np.arange(16 * 3).reshape(16, 3)}, mesh)
    report["rows_per_device"] = sorted(
        {s.data.shape[0] for s in b["x"].addressable_shards}
    )
    report["process_rows"] = str(distributed.process_rows(16, mesh))
    # hidden 36, intermediate 60, vocab 97: {fsdp: 8} divides no axis of the model
    uneven = dataclasses.replace(ADAPTED, vocab_size=97, hidden_size=36,
                                 intermediate_size=60, head_dim=10)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(uneven, uneven.init(jax.random.key(0)), adamw(1e-3), config(),
                mesh={"fsdp": 8}, sharding_rules=RULES)  # fmt: skip
    report["undivided_warnings"] = [str(w.message) for w in caught]
    try:  # 3 × 2 rows per step on 8 devices: refused before anything compiles
        fit(ADAPTED, base, {"data": 2, "fsdp": 4}, batch_size=3, grad_accum=2)
        report["trainer_batch_error"] = None
    except ConfigError as e:
        report["trainer_batch_error"] = str(e)
    local = distributed.host_local_batch({"x": np.arange(16 * 3).reshape(16, 3)}, mesh)
    report["host_local_equal"] = bool(np.array_equal(np.asarray(local["x"]),
                                                     np.asarray(b["x"])))  # fmt: skip
    with open(os.path.join(out, "adapters.json"), "w") as f:
        json.dump(report, f)


def _bf16_fit(model: LlamaConfig, params: object, mesh: object, copy: bool) -> dict:
    """5 LoRA steps of SGD: Adam's sign-like first steps would magnify rounding.

    ``B`` starts at zero. ``copy=False``: the model's loss as a plain function,
    which the Trainer cannot know multiplies in bfloat16 (no copy: the step rounds
    the float32 weights).
    """
    fn = model if copy else loss_for_model(model)
    t = Trainer(fn, params, sgd(0.05), config(max_steps=5), mesh=mesh,
                sharding_rules=RULES, trainable="lora")  # fmt: skip
    r = t.fit(data(model.vocab_size))
    return {"loss": [h["loss"] for h in r.history], "trainer": t,
            "params": host(r.state.trainable)}  # fmt: skip


def _wide_float32(shapes: set) -> int:
    """Live float32 arrays of a frozen projection's shape split over devices."""
    return sum(
        1 for x in jax.live_arrays()
        if x.dtype == np.float32 and x.shape in shapes
        and len(x.sharding.device_set) > 1
    )  # fmt: skip


def bf16_copy(out: str) -> None:
    """Meshes read the frozen half's bfloat16 copy, split like the float32 half."""
    report: dict = {}
    cfg = lora.LoRAConfig(rank=4, alpha=8, targets=lora.ALL_LINEAR, dropout=0.1)
    bf16 = dataclasses.replace(ADAPTED, matmul_dtype="bfloat16")
    refs: dict = {}  # one-device runs: the untied LoRA one serves both its meshes
    for name, tied, quantize, spec in (
        ("lora_fsdp8", False, None, {"fsdp": 8}),
        ("lora_data2_fsdp4", False, None, {"data": 2, "fsdp": 4}),
        ("tied_fsdp8", True, None, {"fsdp": 8}),
        ("qlora_fsdp8", False, "nf4", {"fsdp": 8}),
    ):
        model = dataclasses.replace(bf16, tie_word_embeddings=tied)
        base = model.init(jax.random.key(0))
        params = lora.apply(base, cfg, key=jax.random.key(1), quantize=quantize)
        shapes = {np.shape(w) for w in jax.tree_util.tree_leaves(base)
                  if np.ndim(w) == 3}  # fmt: skip
        if (tied, quantize) not in refs:
            refs[tied, quantize] = _bf16_fit(model, params, None, copy=True)
        ref = refs[tied, quantize]
        run = _bf16_fit(model, params, spec, copy=True)
        alive = _wide_float32(shapes)  # before `plain`, which keeps them placed
        plain = _bf16_fit(model, params, spec, copy=False)
        frozen, one = run["trainer"].state.frozen, ref["trainer"].state.frozen
        devices = distributed.bytes_per_device(frozen)
        report[name] = {
            "loss": run["loss"], "ref_loss": ref["loss"], "plain_loss": plain["loss"],
            "param_rel": [float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                          for a, b in zip(run["params"], ref["params"])],
            "plain_param_diff": max(float(np.max(np.abs(a - b)))
                                    for a, b in zip(run["params"], plain["params"])),
            "copy_equal": all(np.array_equal(a, b)
                              for a, b in zip(host(frozen), host(one), strict=True)),
            "nodes": sorted({type(x).__name__ for x in jax.tree_util.tree_leaves(
                frozen, is_leaf=lambda x: not isinstance(x, lora.LoRAWeight)
                and nn.is_weight_node(x))}),
            "frozen_max_per_device": max(devices.values()),
            "frozen_devices": len(devices),
            "plain_frozen_max_per_device": max(distributed.bytes_per_device(
                plain["trainer"].state.frozen).values()),
            "copy_bytes": tree_bytes(one),
            "float32_bytes": tree_bytes(lora.split(params)[1]),
            "float32_split_alive": alive,
        }  # fmt: skip
        del ref, run, plain
    with open(os.path.join(out, "bf16_copy.json"), "w") as f:
        json.dump(report, f)


def multiprocess(out: str, pid: str, port: str) -> None:
    distributed.initialize(f"127.0.0.1:{port}", 2, int(pid))
    assert jax.process_count() == 2 and jax.device_count() == 8
    params = MODEL.init(jax.random.key(0))
    ref = fit(MODEL, params, None)  # this process's first device alone
    run = fit(
        MODEL, params, {"data": 2, "fsdp": 4}, output_dir=os.path.join(out, "run")
    )
    same(run, ref, f"process {pid}")
    # the checkpoint both processes wrote restores onto the same mesh, bit for bit
    ckpt = Checkpointer(os.path.join(out, "run", "checkpoints"))
    restored, _ = ckpt.restore(run["trainer"].state)
    for a, b in zip(host(restored.trainable), run["params"], strict=True):
        np.testing.assert_array_equal(a, b)
    rows = distributed.process_rows(BATCH, distributed.make_mesh({"fsdp": -1}))
    yaml_files = yaml_run(out, pid)
    with open(os.path.join(out, f"multiprocess{pid}.json"), "w") as f:
        json.dump({"processes": jax.process_count(), "devices": jax.device_count(),
                   "local": jax.local_device_count(), "loss": run["loss"],
                   "rows": [rows.start, rows.stop], "yaml_files": yaml_files},
                  f)  # fmt: skip


def yaml_run(out: str, pid: str) -> list[str]:
    """A YAML run over both processes, FSDP-split (26,624-element first layer).

    It writes its model at the end: process 0 from the gathered arrays (before,
    every process failed there: `np.asarray` of an array split across processes).
    """
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from config_cases import wine_doc, write
    from safetensors.numpy import load_file

    from entrenar.runs.run import train_from_yaml

    folder = Path(out) / "yaml"
    doc = wine_doc(folder, model={"architecture": "mlp",
                                  "config": {"sizes": [13, 2048, 3]}})  # fmt: skip
    doc["training"].update(mesh={"fsdp": -1}, max_steps=2, checkpoint_every=2,
                           eval_every=2)  # fmt: skip
    r = train_from_yaml(write(Path(out) / f"yaml{pid}.yaml", doc), progress=False)
    split = [x for x in jax.tree_util.tree_leaves(r.train.state.trainable)
             if not x.is_fully_addressable and not x.is_fully_replicated]  # fmt: skip
    assert split, "nothing was split over the two processes: the check is void"
    if jax.process_index() == 0:
        saved = load_file(r.files["safetensors"])
        trainable = r.train.state.trainable
        names = [n for n, _ in tree_named_leaves(trainable)]
        assert sorted(names) == sorted(saved)
        for name, value in zip(names, host(trainable), strict=True):
            np.testing.assert_array_equal(saved[name], value, err_msg=name)
    else:
        host(r.train.state.trainable)  # the gather is a collective: both take part
    return sorted(r.files)


def eight(out: str) -> None:
    meshes(out)  # first: the resumptions wait for its checkpoint
    adapters(out)


if __name__ == "__main__":
    check, out, *args = sys.argv[1:]
    {"meshes": meshes, "resume": resume, "adapters": adapters, "eight": eight,
     "multiprocess": multiprocess,
     "bf16_copy": bf16_copy}[check](out, *args)  # fmt: skip
