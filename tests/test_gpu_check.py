"""benchmarks/gpu_check.py --cpu-smoke: the GPU check's every section, tiny, on the CPU.

The script runs on a GPU only now and then; this runs the same code (each section's
worker processes, the report) with tiny shapes so that it cannot rot between runs.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_writes_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-smoke",
         "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    report = out.read_text()
    assert proc.returncode == 0, report + proc.stderr[-3000:]
    assert "FAILED" not in report and "**NO**" not in report
    assert "## Numerics: device vs CPU reference" in report
    for check in ("logits", "gradients", "lora step", "qlora step", "optimizer adamw",
                  "fused attention"):  # fmt: skip
        assert f"| {check}" in report or f"{check}" in report
    assert "restored in a `JAX_PLATFORMS=cpu` process" in report
    assert ": equal." in report
    rows = [x for x in report.splitlines() if x.startswith("| tiny | 1x16 |")]
    variants = {x.split("|")[3].strip() for x in rows}
    assert {"lora", "qlora"} <= variants, report
    assert "skipped: the time budget" not in report


def test_a_smoke_run_never_writes_the_device_results_file():
    """results/gpu.md holds the device's figures; a smoke run's default is elsewhere.

    Before: ``--cpu-smoke`` without ``--out`` wrote benchmarks/results/gpu.md, which a
    commit could then carry as issue 32's GPU results.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_check", ROOT / "benchmarks" / "gpu_check.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.default_out(False) == ROOT / "benchmarks" / "results" / "gpu.md"
    assert ROOT not in mod.default_out(True).parents
