"""The tiny trained checkpoint in the release's dtypes on the Triton set against the same
checkpoint dequantized on the reference kernels, on every bench prompt.

    TRITON_INTERPRET=1 PYTHONPATH=. python3 perf/quant_triton_check.py [--prompts 8]
        [--new-tokens 16] [--device cpu|cuda]

Writes the checkpoint with ``quantize="fp8"`` (FP8 linears, FP4 routed experts, e8m0
scales) to a temporary directory, then decodes the bench's prompts (seed 11) with
speculative decoding on the fused kernels (every quantized GEMM on the stored bits,
sparse attention, indexer and compressor over index lists; ``cpu`` graphs, one fused
round per bucket) and with no-cache greedy decoding of the dequantized model on the
reference kernels. Prints the tokens that differ (0 expected), the acceptance, and the
largest logit difference of the first prompt's prefill relative to its largest logit.
On a CPU the kernels run under Triton's interpreter: minutes, and times mean nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from nextn_graph.bench.measure import bench_prompts
from nextn_graph.checkpoint import load_checkpoint, save_checkpoint
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.memory.batch import Chunk, ForwardBatch
from nextn_graph.memory.pool import PoolLayout
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.generate import reference_generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        trained = load_checkpoint("builtin:tiny-trained")
        path = save_checkpoint(trained, Path(tmp) / "fp8", quantize="fp8")
        fused = load_checkpoint(path, device=args.device, kernels="triton")
        plain = load_checkpoint(path, device=args.device, weights="dequantized",
                                kernels="reference")
        prompts = bench_prompts(fused.cfg.vocab_size, args.prompts, seed=11)
        context = max(map(len, prompts)) + args.new_tokens + 8
        logits = []
        for models in (fused, plain):
            pool = models.target.new_pool(PoolLayout(1, context, 4))
            batch = ForwardBatch.from_chunks([Chunk(pool.alloc(), 0, prompts[0])],
                                             device=args.device)
            logits.append(models.target(batch, pool).logits.float())
        rel = float((logits[0] - logits[1]).abs().max() / logits[1].abs().max())
        want = reference_generate(plain.target, prompts, args.new_tokens, stop_ids=set()).outputs
        graph = GraphConfig(backend="cuda" if args.device == "cuda" else "cpu",
                            buckets=(args.prompts,), round="fused")
        engine = SpecEngine(fused.target, fused.draft, SpeculativeConfig(num_steps=3),
                            PoolConfig(max_requests=args.prompts, max_context=context), graph)
        got = engine.generate(prompts, args.new_tokens, stop_ids=[])
    differ = sum(a != b for g, w in zip(got.outputs, want) for a, b in zip(g, w))
    total = sum(map(len, want))
    stats = got.stats
    accept = stats["acceptance_length"]
    print(f"prompts {args.prompts} x {args.new_tokens} new tokens: {differ} of {total} tokens "
          f"differ; graph replays {stats['graph_replays']}, acceptance length {accept:.2f}; "
          f"prefill logits max |fused - reference| / max |reference| = {rel:.2e}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
