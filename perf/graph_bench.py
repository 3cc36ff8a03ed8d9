"""The replay benchmark (same as ``nextn-graph bench``): eager vs graph submissions and
round latency per bucket, speculative vs plain, capture time and memory.

    python perf/graph_bench.py                                   # the CPU default
    python perf/graph_bench.py --config capture_configs/cuda.yaml --json out.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from nextn_graph.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
