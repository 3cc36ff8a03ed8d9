"""Random-schedule soak: speculative output vs plain greedy decoding, for a while.

Draws engines (trained or random model, num_steps 1/2/3/5, eager or cpu graphs
with buckets 1, 2, 4 and a pool of 5) and schedules (1-7 requests arriving at
random steps, prompts of 1-150 tokens, max_new_tokens 1-60, random stop tokens),
and checks every request's tokens against plain greedy decoding. Longer and
wider than the hypothesis test in the suite; prints mismatches and a summary.

    python perf/sweep.py --seconds 300 --seed 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from nextn_graph.checkpoint import load_checkpoint, random_models  # noqa: E402
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig  # noqa: E402
from nextn_graph.generate import plain_generate  # noqa: E402
from nextn_graph.presets import preset_config  # noqa: E402
from nextn_graph.runtime.engine import SpecEngine  # noqa: E402
from nextn_graph.train import Corpus, TrainSettings  # noqa: E402

POOL = PoolConfig(5, 320)


def draw_prompt(rng: random.Random, vocab: int) -> list[int]:
    n = rng.randint(1, 150)
    if rng.random() < 0.6:  # in-distribution for the trained draft
        corpus = Corpus(vocab, TrainSettings().phrases, torch.Generator().manual_seed(rng.randint(0, 999)))
        return corpus.sample(n)
    return [rng.randint(2, vocab - 1) for _ in range(n)]


def run_schedule(rng: random.Random, engine: SpecEngine, target) -> int:
    """One random schedule on ``engine``; returns the number of mismatching requests."""
    reqs = []
    for _ in range(rng.randint(1, 7)):
        prompt, max_new = draw_prompt(rng, target.cfg.vocab_size), rng.randint(1, 60)
        ref = plain_generate(target, [prompt], max_new, stop_ids=set(),
                             max_context=POOL.max_context).outputs[0]
        stops: set[int] = set()
        if rng.random() < 0.3 and len(ref) > 1:
            stops = {ref[rng.randint(0, len(ref) - 1)]}
            ref = ref[: next(i for i, t in enumerate(ref) if t in stops) + 1]
        reqs.append((rng.randint(0, 6), prompt, max_new, stops, ref))
    got: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    pending, step = list(range(len(reqs))), 0
    while pending or engine.has_work:
        for i in [i for i in pending if reqs[i][0] <= step]:
            owner[engine.add_request(reqs[i][1], reqs[i][2], stop_ids=list(reqs[i][3]))] = i
            got[i] = []
            pending.remove(i)
        for out in engine.step():
            got[owner[out.rid]].extend(out.new_tokens)
        step += 1
    bad = [i for i, r in enumerate(reqs) if got[i] != r[4]]
    for i in bad:
        print(f"MISMATCH prompt len {len(reqs[i][1])} max_new {reqs[i][2]}: "
              f"{got[i][:12]} vs {reqs[i][4][:12]}")
    return len(bad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = {"trained": load_checkpoint("builtin:tiny-trained"),
              "random": random_models(preset_config("tiny"), 0)}
    rng, engines = random.Random(args.seed), {}
    schedules = mismatches = 0
    start = time.time()
    while time.time() - start < args.seconds:
        key = (rng.choice(sorted(models)), rng.choice([1, 2, 3, 5]), rng.choice(["eager", "cpu"]))
        if key not in engines:
            m = models[key[0]]
            spec = SpeculativeConfig(num_steps=key[1], num_draft_tokens=key[1] + 1)
            engines[key] = SpecEngine(m.target, m.draft, spec, POOL,
                                      GraphConfig(backend=key[2], buckets=(1, 2, 4)))
        mismatches += run_schedule(rng, engines[key], models[key[0]].target)
        schedules += 1
    print(f"{schedules} schedules on {len(engines)} engines, {mismatches} mismatching requests")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
