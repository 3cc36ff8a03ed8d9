"""Everything a CUDA machine should prove, in one run, into one JSON.

    PYTHONPATH=. python3 perf/device_check.py --out device_check_out

1. versions (python, torch, CUDA, the GPU);
2. the CUDA-marked tests (`pytest -m cuda`: graph parity, pinned transfers,
   side-stream capture, the compile backend on inductor / reduce-overhead, every fused
   Triton kernel against its reference and the tiny checkpoint on them);
2b. `perf/kernel_bench.py`: each fused op against its reference at V4-Flash widths,
   time and achieved GB/s, in bf16 and fp32: part 1's glue, the quantized GEMMs on the
   stored bits, sparse attention and the indexer at 4K and 128K cached positions
   (``--device cpu``: tiny widths under Triton's interpreter);
3. the replay benchmark on `capture_configs/cuda.yaml` (tiny trained checkpoint),
   with its torch.compile peer (reduce-overhead) unless ``--compile-peer none``;
4. the `flash-slice` checkpoint written once, then the benchmark on
   `capture_configs/flash_slice_cuda.yaml` (real DeepSeek-V4-Flash widths).

Each step runs in its own process with a time limit; a failed step is recorded
with its exit code and output tail, and the others still run. Nothing is
installed: on the lent H200 the copied tree runs with its preinstalled torch.
``--device cpu`` runs the same steps on the CPU configs, as a dry run of the
script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "platform": platform.platform()}
    if torch.cuda.is_available():
        out.update(gpu=torch.cuda.get_device_name(0),
                   gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return out


def run(name: str, cmd: list[str], timeout: int, interpret: bool = False) -> dict:
    """One step in a subprocess: exit code, wall seconds, the output's last lines.
    ``interpret``: Triton kernels under the interpreter (on CPU tensors)."""
    print(f"[device_check] {name}: {' '.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = "timeout", (exc.stdout or "") + (exc.stderr or "")
        text = text.decode() if isinstance(text, bytes) else text
    step = {"cmd": cmd, "rc": rc, "seconds": round(time.perf_counter() - start, 1),
            "tail": text.splitlines()[-25:]}
    print(f"[device_check] {name}: rc={rc} in {step['seconds']} s", flush=True)
    return step


def bench(name: str, config: str, out: Path, timeout: int, *extra: str) -> dict:
    json_path = out / f"{name}.json"
    step = run(name, [sys.executable, "-m", "nextn_graph", "bench", "--config", config,
                      "--out", str(out / name), "--json", str(json_path), "--quiet", *extra],
               timeout)
    if step["rc"] == 0 and json_path.is_file():
        step["report"] = json.loads(json_path.read_text())
    return step


def kernel_bench(dtype: str, out: Path, cuda: bool) -> dict:
    json_path = out / f"kernels_{dtype}.json"
    cmd = [sys.executable, "perf/kernel_bench.py", "--dtype", dtype, "--json", str(json_path)]
    if not cuda:  # a dry run: tiny widths under the interpreter, a handful of calls
        cmd += ["--device", "cpu", "--iters", "2", "--repeats", "1", "--rows", "4"]
    step = run(f"kernels_{dtype}", cmd, 1200, interpret=not cuda)
    if step["rc"] == 0 and json_path.is_file():
        step["report"] = json.loads(json_path.read_text())
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("device_check_out"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rounds", default="32", help="timed rounds per bench run")
    ap.add_argument("--repeats", default="3", help="bench runs per mode")
    ap.add_argument("--compile-peer", default=None,
                    help="override the configs' bench.compile_peer (none: skip the torch.compile "
                         "peer, whose inductor compiles take minutes)")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=("tests", "kernels", "bench", "flash"),
                    help="steps to leave out (e.g. flash where the host RAM is short)")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    timed = ("--rounds", args.rounds, "--repeats", args.repeats)
    if args.compile_peer is not None:
        timed += ("--compile-peer", args.compile_peer)
    result: dict = {"versions": versions(), "device": args.device, "steps": {}}
    steps = result["steps"]
    if "tests" not in args.skip:
        marker = "cuda" if cuda else "not slow"
        steps["tests"] = run("tests", [sys.executable, "-m", "pytest", "-q", "-m", marker,
                                       "-p", "no:cacheprovider"], 1800)
    if "kernels" not in args.skip:
        for dtype in ("bf16", "fp32"):
            steps[f"kernels_{dtype}"] = kernel_bench(dtype, out, cuda)
    if "bench" not in args.skip:
        config = "capture_configs/cuda.yaml" if cuda else "capture_configs/cpu_default.yaml"
        steps["bench"] = bench("bench", config, out, 1800, *timed)
    if "flash" not in args.skip:
        ckpt = out / "flash-slice"
        if not (ckpt / "config.json").is_file():
            steps["flash_checkpoint"] = run("flash_checkpoint", [
                sys.executable, "-m", "nextn_graph", "make-checkpoint", "--preset",
                "flash-slice", "--out", str(ckpt), "--shard-bytes", "2000000000"], 1800)
        config = ("capture_configs/flash_slice_cuda.yaml" if cuda
                  else "capture_configs/flash_slice_cpu.yaml")
        steps["flash_bench"] = bench("flash_bench", config, out, 3600, "--checkpoint",
                                     str(ckpt), *timed)
    path = out / "device_check.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    failed = [k for k, v in steps.items() if v["rc"] != 0]
    print(f"[device_check] wrote {path}; failed steps: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
