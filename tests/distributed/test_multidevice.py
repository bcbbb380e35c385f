"""Training on simulated CPU devices matches one device, in subprocesses.

The device count is fixed when jax is imported, so each check runs
`run_distributed.py` with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.

All checks start together when the module's first test runs (compiling dominates;
on a loaded machine waiting processes overlap; the resumptions wait for the 8-device
run's checkpoint), each test then waits for its own. The two 8-device checks (meshes,
adapters) share one process: one jax start-up fewer. Tolerances are 1e-5: the meshes
sum gradients in another order than one device does, so results agree to float32
rounding, not bit for bit.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("run_distributed.py")
TIMEOUT = 900
RESUMES = {1: "null", 4: '{"data": 2, "fsdp": 2}'}  # devices: mesh


def _start(args, out, devices):
    flags = (
        f"--xla_force_host_platform_device_count={devices} "
        "--xla_cpu_use_fusion_emitters=false"
    )
    # tiny models: every run compiles without most XLA optimizations, meshes and the
    # one-device reference alike (cold cache: 133 -> 87 CPU-s for the module), and
    # with XLA:CPU's older elemental fusion emitter, as test_family_meshes.py's
    # (95.6 -> 57.8 CPU-s)
    env = {
        **os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
    }  # fmt: skip
    tag = args[1] if args[0] == "multiprocess" else ""
    log = open(Path(out) / f"{args[0]}{tag}.log", "w")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), args[0], str(out), *args[1:]],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _wait(proc, out):
    try:
        rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if rc != 0:
        logs = "\n".join(p.read_text()[-4000:] for p in Path(out).glob("*.log"))
        pytest.fail(f"{proc.args[2:4]} exited with {rc}:\n{logs}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    names = ("eight", "mp", *(f"resume{n}" for n in RESUMES))
    dirs = {k: tmp_path_factory.mktemp(k) for k in names}
    port = str(_free_port())
    procs = {
        "eight": _start(["eight"], dirs["eight"], 8),  # meshes, then adapters
        "mp0": _start(["multiprocess", "0", port], dirs["mp"], 4),
        "mp1": _start(["multiprocess", "1", port], dirs["mp"], 4),
        **{  # each waits for the 8-device run's step-10 checkpoint
            f"resume{n}": _start(
                ["resume", str(dirs["eight"]), mesh], dirs[f"resume{n}"], n
            )
            for n, mesh in RESUMES.items()
        },
    }
    yield procs, dirs
    for p in procs.values():
        if p.poll() is None:
            p.kill()


def _result(runs, name, proc_names, file):
    procs, dirs = runs
    for n in proc_names:
        _wait(procs[n], dirs[name])
    return json.loads((dirs[name] / file).read_text())


@pytest.mark.slow
def test_meshes_match_one_device_and_fsdp_holds_an_eighth(runs):
    # the script asserts loss curves and final params equal to 1e-5 for
    # {data: 8}, {fsdp: 8}, {data: 2, fsdp: 4}; here: the memory it measured
    r = _result(runs, "eight", ["eight"], "meshes.json")
    assert r["moved"] > 1e-3 and len(r["loss"]) == 20  # params moved: not trivial
    b = r["bytes"]
    assert b["data8"]["max_per_device"] == b["data8"]["total"]  # replicated
    # FSDP: params + optimizer moments split in 8; only the replicated scalars
    # (Adam's count, the learning rate) are held by every device
    assert b["fsdp8"]["max_per_device"] <= b["fsdp8"]["total"] / 8 + 16
    assert b["data2_fsdp4"]["max_per_device"] <= b["data2_fsdp4"]["total"] / 4 + 16


@pytest.mark.slow
@pytest.mark.parametrize("devices", sorted(RESUMES))
def test_checkpoint_of_8_devices_resumes_on_fewer(runs, devices):
    procs, dirs = runs
    resume, meshes = procs[f"resume{devices}"], procs["eight"]
    while resume.poll() is None and meshes.poll() in (None, 0):
        time.sleep(0.5)  # (a failed 8-device run never writes the checkpoint)
    if resume.poll() is None:
        resume.kill()
        _wait(meshes, dirs["eight"])
    _wait(resume, dirs[f"resume{devices}"])  # asserts params equal the full run's
    r = json.loads((dirs[f"resume{devices}"] / "resume.json").read_text())
    assert r["devices"] == devices and r["steps"] == 20
    if devices == 4:
        assert any("'fsdp'" in s for s in r["shardings"])


@pytest.mark.slow
def test_lora_and_qlora_match_one_device(runs):
    r = _result(runs, "eight", ["eight"], "adapters.json")
    for name in ("lora", "qlora"):
        assert r[name]["trainable_specs"] == ["()"]  # adapters replicated
    assert "(None, 'fsdp')" in r["qlora"]["frozen_specs"]  # NF4 codes split
    assert "make the batch size a multiple of 8" in r["batch_error"]
    assert r["rows_per_device"] == [2] and r["host_local_equal"]
    # FSDP that can split nothing says so (it trained correctly, but every device
    # held the whole model)
    (warning,) = [w for w in r["undivided_warnings"] if "FSDP over 8" in w]
    share = re.search(r"(\d+)% of the params\) whole on every device", warning)
    assert share and int(share[1]) > 50, warning
    # the Trainer names both knobs (shard_batch's message, at the first step, named
    # "the batch size" for rows that were batch_size × grad_accum)
    assert (
        "batch_size × grad_accum = 3 × 2) do not split over the mesh's 8"
        in (r["trainer_batch_error"])
    )


@pytest.mark.slow
def test_two_processes_train_like_one(runs):
    a = _result(runs, "mp", ["mp0", "mp1"], "multiprocess0.json")
    b = json.loads((runs[1]["mp"] / "multiprocess1.json").read_text())
    assert (a["processes"], a["devices"], a["local"]) == (2, 8, 4)
    assert a["loss"] == b["loss"]  # one computation, read by both
    assert (a["rows"], b["rows"]) == ([0, 4], [4, 8])
    # the YAML run's outputs: written by process 0 (equal to the trained arrays,
    # checked by the script), none by process 1
    assert "safetensors" in a["yaml_files"] and b["yaml_files"] == []
    run = runs[1]["mp"] / "run"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["20"]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 20  # written by process 0 only
