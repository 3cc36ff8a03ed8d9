"""Host memory while loading a checkpoint: peak RSS against what the model keeps.

    python perf/load_memory.py --checkpoint DIR            # an existing checkpoint
    python perf/load_memory.py --preset flash-slice --quantize fp8 --work /tmp/ck

Each load runs in a fresh process (``weights: quantized`` and ``dequantized``), which
reports its RSS after imports, its peak RSS (``ru_maxrss``) and the resident bytes
of the loaded weights by storage. ``overhead`` = peak - baseline - resident: what
loading needed beyond the model itself, to compare with the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(checkpoint: str, weights: str, dtype: str) -> dict:
    import torch

    from nextn_graph.checkpoint import load_checkpoint
    from nextn_graph.checkpoint.loader import weight_bytes
    from nextn_graph.checkpoint.weights import scan

    infos = scan(Path(checkpoint))
    base = _rss_mib()
    models = load_checkpoint(checkpoint, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype],
                             weights=weights)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    resident = weight_bytes(models)
    return {"weights": weights, "dtype": dtype, "baseline_mib": round(base, 1),
            "peak_mib": round(peak, 1), "after_mib": round(_rss_mib(), 1),
            "resident_mib": {k: round(v / 2**20, 1) for k, v in resident.items()},
            "largest_tensor_mib": round(max(i.nbytes for i in infos.values()) / 2**20, 1),
            "files_mib": round(sum(i.nbytes for i in infos.values()) / 2**20, 1),
            "overhead_mib": round(peak - base - resident["total"] / 2**20, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="an existing checkpoint directory")
    ap.add_argument("--preset", default="tiny", help="else: make this preset first")
    ap.add_argument("--quantize", default="fp8", choices=("none", "fp8"))
    ap.add_argument("--work", default="/tmp/nextn_load_memory", help="where to make it")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.dtype)))
        return 0
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = str(Path(args.work) / f"{args.preset}-{args.quantize}")
        if not (Path(checkpoint) / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "nextn_graph", "make-checkpoint", "--preset",
                            args.preset, "--quantize", args.quantize, "--out", checkpoint,
                            "--shard-bytes", "2000000000"], check=True, cwd=REPO)
    rows = []
    for weights in ("quantized", "dequantized"):
        out = subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--child",
                              checkpoint, weights], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"checkpoint": checkpoint, "loads": rows}, indent=2))
    for r in rows:
        print(f"{r['weights']:>11} {r['dtype']}: peak RSS {r['peak_mib']} MiB = baseline "
              f"{r['baseline_mib']} + weights {r['resident_mib']['total']} + overhead "
              f"{r['overhead_mib']} (largest tensor {r['largest_tensor_mib']} MiB, files "
              f"{r['files_mib']} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
