"""How busy other processes kept the CPU during a timed section: a noise gauge for
benchmarks on a shared 2-core machine (torch's spinning threads slow down several-fold
when another process takes a core)."""

from __future__ import annotations

import os
import resource


def cpu_snapshot() -> tuple[float, float] | None:
    """(machine-wide busy CPU seconds, this process's CPU seconds), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return busy, ru.ru_utime + ru.ru_stime


def foreign_cores(start, end, wall_s: float) -> float | None:
    """Average cores other processes kept busy between two :func:`cpu_snapshot` readings
    (0 when this process had the machine to itself)."""
    if start is None or end is None or wall_s <= 0:
        return None
    return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / wall_s)
