"""Each fused op against its reference: time per call and achieved bandwidth.

    PYTHONPATH=. python3 perf/kernel_bench.py --device cuda [--dtype bf16] [--rows 32]

At DeepSeek-V4-Flash widths (``--widths v4``, default) with T rows (32: a bucket of 8
verifying 4 tokens), every case of ``nextn_graph/kernels/cases.py`` and
``cases_sparse.py`` (the quantized GEMMs; sparse attention and the indexer at requests of
``--contexts`` cached positions, 4K and 128K) is checked against
its reference (``max |fused - reference|`` relative to the reference's largest value)
and timed: the median of ``--repeats`` runs of ``--iters`` calls, with CUDA events on a
GPU. GB/s is the fused kernel's unavoidable traffic (inputs read, outputs written) over
its time, and ``of peak`` that against the device's bandwidth (``--bandwidth``, default
an H200's nominal 4.8 TB/s). ``--device cpu`` runs the Triton kernels under the
interpreter (set ``TRITON_INTERPRET=1``) at ``--widths tiny``: a dry run of the script,
whose times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from nextn_graph.kernels.cases import TINY, V4_FLASH, cases
from nextn_graph.kernels.cases_sparse import SPARSE_CONTEXTS, gemm_cases, sparse_cases

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _timed(fn, iters: int, repeats: int, cuda: bool) -> float:
    """Median seconds per call."""
    fn()  # compile / warm
    runs = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            runs.append((time.perf_counter() - t0) / iters)
    return statistics.median(runs)


def _error(fused, ref) -> float:
    """Largest |fused - reference| over the float outputs, relative to the reference's
    largest value; -1 where an integer output differs."""
    fused = fused if isinstance(fused, tuple) else (fused,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    worst = 0.0
    for a, b in zip(fused, ref, strict=True):
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return -1.0
            continue
        scale = b.float().abs().max().clamp(min=1e-30)
        worst = max(worst, float((a.float() - b.float()).abs().max() / scale))
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--widths", choices=("v4", "tiny"), default=None,
                    help="default: v4 on cuda, tiny on cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s of the device")
    ap.add_argument("--contexts", default=None,
                    help="cached positions of the sparse cases, comma-separated (default "
                         f"{','.join(map(str, SPARSE_CONTEXTS))} on cuda, 256,1024 on cpu)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    widths = {"v4": V4_FLASH, "tiny": TINY}[args.widths or ("v4" if cuda else "tiny")]
    rows = []
    print(f"{'op':<22} {'rel err':>9} {'fused us':>10} {'ref us':>10} {'speed-up':>9} "
          f"{'GB/s':>8} {'of peak':>8}")
    with torch.no_grad():
        dtype, gen = DTYPES[args.dtype], torch.Generator().manual_seed(1)
        contexts = tuple(int(c) for c in (args.contexts or (
            ",".join(map(str, SPARSE_CONTEXTS)) if cuda else "256,1024")).split(","))
        every = (cases(args.rows, widths, dtype, args.device)
                 + gemm_cases(args.rows, widths, dtype, args.device, gen)
                 + sparse_cases(args.rows, widths, dtype, args.device, gen, contexts))
        for case in every:
            err = _error(case.fused(), case.reference())
            fused = _timed(case.fused, args.iters, args.repeats, cuda)
            ref = _timed(case.reference, args.iters, args.repeats, cuda)
            gbs = case.nbytes / fused / 1e9
            row = {"op": case.name, "rel_err": err, "fused_us": fused * 1e6,
                   "reference_us": ref * 1e6, "speedup": ref / fused, "bytes": case.nbytes,
                   "gb_s": gbs, "of_peak": gbs * 1e9 / args.bandwidth}
            rows.append(row)
            print(f"{case.name:<22} {err:>9.2e} {fused * 1e6:>10.1f} {ref * 1e6:>10.1f} "
                  f"{ref / fused:>8.2f}x {gbs:>8.1f} {row['of_peak']:>7.1%}")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": args.device, "dtype": args.dtype,
                                         "rows": args.rows, "widths": widths.__dict__,
                                         "ops": rows}, indent=2) + "\n")
    return 1 if any(r["rel_err"] < 0 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
