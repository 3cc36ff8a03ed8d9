"""Where and when a figure was measured: the reports of ``bench`` and ``bench-serve`` are
dated and name the machine, so a number quoted from them can be traced."""

from __future__ import annotations

import datetime
import os
import platform


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_stamp() -> dict:
    """{"date": "YYYY-MM-DD HH:MM UTC", "cpu": model name, "cores": logical CPUs}."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_name(), "cores": os.cpu_count()}
