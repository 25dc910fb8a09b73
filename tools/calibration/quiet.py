"""Whether other jobs keep the machine busy: they distort timings, so measurements wait for quiet."""
from __future__ import annotations

import os
import time


def load() -> float:
    return os.getloadavg()[0]


def cpu_busy(seconds: float = 1.0) -> float:
    """Share of all cores' time spent busy over the next ``seconds`` (from /proc/stat). Unlike
    the load average it has no memory of this tool's own previous runs, and gloo's sleeping
    threads do not count."""
    def snapshot():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    total0, idle0 = snapshot()
    time.sleep(seconds)
    total1, idle1 = snapshot()
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_quiet(max_busy: float) -> float:
    """Waits until other jobs keep at most ``max_busy`` of the cores busy for 3 s in a row (they
    distort timings; call it while this tool runs nothing); returns the last busy share."""
    quiet = 0
    while quiet < 3:
        busy = cpu_busy()
        quiet = quiet + 1 if busy <= max_busy else 0
    return busy
