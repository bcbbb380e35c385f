"""What every benchmark reports about the machine it ran on: CPU, load, peak memory.

The machine is shared and its CPU changes from run to run, so each result names the
CPU and the load average it was measured under; memory is read as the kernel's
``VmHWM`` (the peak resident set of this process so far).
"""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> str:
    """The 1/5/15-minute load averages, as ``"1.2/0.8/0.5"``."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def peak_rss() -> int:
    """Peak resident bytes of this process so far (``VmHWM``; 0 where unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
