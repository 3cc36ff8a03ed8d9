"""The replay benchmark behind ``nextn-graph bench`` and ``perf/graph_bench.py``."""

from .measure import BenchSettings
from .run import run_bench

__all__ = ["BenchSettings", "run_bench"]
