"""Random-schedule soak: speculative decoding vs plain greedy and the fp32 oracle.

Draws engines (trained or random model, num_steps 1/2/3/5, eager or cpu graphs
with buckets 1, 2, 4 and a pool of 5) and schedules (1-7 requests arriving at
random steps, prompts of 1-150 tokens, max_new_tokens 1-60, random stop tokens).

- fp32: every request's tokens must equal plain greedy decoding exactly.
- bf16: exact agreement is only a figure (the CPU's fp32 GEMMs round differently
  for different row counts, and the casts back to bf16 turn that into whole-ulp
  differences), so it prints how often spec == plain and each == the fp32
  reference, and where a bf16 stream leaves the fp32 reference, the reference's
  top-2 margin and the picked token's regret (its fp32 logit below the
  reference's choice). The check is the bf16 guarantee (docs/guarantees_bf16.md):
  regret below BF16_TOLERANCE (nextn_graph/runtime/tolerance.py).

Exits 1 on an fp32 mismatch or a bf16 divergence at regret BF16_TOLERANCE or more.

    python perf/sweep.py --seconds 300 --seed 1 [--dtype both|fp32|bf16] [--delta D]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from nextn_graph.checkpoint import load_checkpoint, random_models  # noqa: E402
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig  # noqa: E402
from nextn_graph.runtime.generate import plain_generate, reference_generate  # noqa: E402
from nextn_graph.checkpoint.presets import preset_config  # noqa: E402
from nextn_graph.runtime.engine import SpecEngine  # noqa: E402
from nextn_graph.runtime.tolerance import (BF16_TOLERANCE, divergence_regret,  # noqa: E402
                                           first_divergence, reference_logits, top2_margins,
                                           within_tolerance)
from nextn_graph.checkpoint.corpus import corpus  # noqa: E402

POOL = PoolConfig(5, 320)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Req:
    arrival: int  # the step() before which it is added
    prompt: list[int]
    max_new: int
    stops: frozenset[int]
    want: list[int]  # the oracle's tokens under these limits


@dataclass
class Bf16Tally:
    requests: int = 0
    spec_eq_plain: int = 0
    spec_eq_ref: int = 0
    plain_eq_ref: int = 0
    margins: list[float] = field(default_factory=list)  # the reference's top-2 margin and
    regrets: list[float] = field(default_factory=list)  # the picked token's regret, per divergence
    positions: int = 0  # reference positions, and those where the runner-up is in tolerance
    near_ties: int = 0
    wrong_tokens: int = 0  # (position, token other than the reference's), and those in tolerance
    tolerated_tokens: int = 0
    violations: int = 0


def draw_prompt(rng: random.Random, vocab: int) -> list[int]:
    n = rng.randint(1, 150)
    if rng.random() < 0.6:  # in-distribution for the trained draft
        return corpus(vocab, rng.randint(0, 999)).sample(n)
    return [rng.randint(2, vocab - 1) for _ in range(n)]


def draw_requests(rng: random.Random, vocab: int, oracle) -> list[Req]:
    """1-7 requests; ``oracle(prompt, max_new)`` gives the tokens with no stop ids."""
    reqs = []
    for _ in range(rng.randint(1, 7)):
        prompt, max_new = draw_prompt(rng, vocab), rng.randint(1, 60)
        want = oracle(prompt, max_new)
        stops: frozenset[int] = frozenset()
        if rng.random() < 0.3 and len(want) > 1:
            stops = frozenset([want[rng.randint(0, len(want) - 1)]])
            want = want[: next(i for i, t in enumerate(want) if t in stops) + 1]
        reqs.append(Req(rng.randint(0, 6), prompt, max_new, stops, want))
    return reqs


def run_schedule(engine: SpecEngine, reqs: list[Req]) -> list[list[int]]:
    """Requests join at their arrival step; returns every request's tokens."""
    got: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    pending, step = list(range(len(reqs))), 0
    while pending or engine.has_work:
        for i in [i for i in pending if reqs[i].arrival <= step]:
            r = reqs[i]
            owner[engine.add_request(r.prompt, r.max_new, stop_ids=list(r.stops))] = i
            got[i] = []
            pending.remove(i)
        for out in engine.step():
            got[owner[out.rid]].extend(out.new_tokens)
        step += 1
    return [got[i] for i in range(len(reqs))]


def check_fp32(rng: random.Random, engine: SpecEngine, target) -> tuple[int, int]:
    """fp32: spec must equal plain greedy exactly; returns (requests, mismatching ones)."""
    def oracle(prompt, max_new):
        return plain_generate(target, [prompt], max_new, stop_ids=set(),
                              max_context=POOL.max_context).outputs[0]
    reqs = draw_requests(rng, target.cfg.vocab_size, oracle)
    got = run_schedule(engine, reqs)
    bad = [i for i, r in enumerate(reqs) if got[i] != r.want]
    for i in bad:
        print(f"fp32 MISMATCH prompt len {len(reqs[i].prompt)} max_new {reqs[i].max_new}: "
              f"{got[i][:12]} vs {reqs[i].want[:12]}")
    return len(reqs), len(bad)


def check_bf16(rng: random.Random, engine: SpecEngine, target16, target32, tally: Bf16Tally,
               delta: float) -> None:
    """bf16: exact-agreement figures, and the tolerance guarantee against the fp32 reference."""
    def oracle(prompt, max_new):
        return reference_generate(target32, [prompt], max_new, stop_ids=set(),
                                  max_context=POOL.max_context).outputs[0]
    reqs = draw_requests(rng, target32.cfg.vocab_size, oracle)
    got = run_schedule(engine, reqs)
    for r, spec in zip(reqs, got):
        plain = plain_generate(target16, [r.prompt], r.max_new, stop_ids=set(r.stops),
                               max_context=POOL.max_context).outputs[0]
        logits = reference_logits(target32, r.prompt, r.want)  # [len(want), V]
        margins = top2_margins(logits)
        tally.requests += 1
        tally.spec_eq_plain += spec == plain
        tally.spec_eq_ref += spec == r.want
        tally.plain_eq_ref += plain == r.want
        tally.positions += len(margins)
        tally.near_ties += sum(m < delta for m in margins)
        gaps = logits.gather(1, torch.tensor(r.want).unsqueeze(1)) - logits  # [len(want), V]
        tally.wrong_tokens += gaps.numel() - len(margins)
        tally.tolerated_tokens += int((gaps < delta).sum()) - len(margins)
        for name, stream in (("spec", spec), ("plain", plain)):
            regret = divergence_regret(stream, r.want, logits)
            if regret is None:
                continue
            i = first_divergence(stream, r.want)
            if i < len(margins):
                tally.margins.append(margins[i])
                tally.regrets.append(regret)
            if not within_tolerance(stream, r.want, logits, delta):
                tally.violations += 1
                print(f"bf16 VIOLATION {name} at token {i}, regret {regret:.4f}: "
                      f"{stream[max(i - 2, 0):i + 3]} vs fp32 reference "
                      f"{r.want[max(i - 2, 0):i + 3]}; max_new {r.max_new} stops "
                      f"{sorted(r.stops)} prompt {r.prompt}")


def summary(values: list[float]) -> str:
    v = sorted(values)
    return (f"min {v[0]:.4f}, median {statistics.median(v):.4f}, max {v[-1]:.4f}"
            if v else "none")


def report_bf16(model: str, t: Bf16Tally, delta: float) -> None:
    def pct(k: int, n: int) -> str:
        return f"{k}/{n} ({100 * k / max(n, 1):.1f}%)"
    print(f"bf16, {model} model: {t.requests} requests")
    print(f"  exact: spec == plain {pct(t.spec_eq_plain, t.requests)}, spec == fp32 reference "
          f"{pct(t.spec_eq_ref, t.requests)}, plain == fp32 reference "
          f"{pct(t.plain_eq_ref, t.requests)}")
    print(f"  {len(t.regrets)} streams leave the fp32 reference; there, its top-2 margin: "
          f"{summary(t.margins)}; the picked token's regret: {summary(t.regrets)}")
    print(f"  tolerance delta {delta}: {t.violations} divergences at regret >= delta; "
          f"in tolerance: the runner-up at {pct(t.near_ties, t.positions)} positions, "
          f"any other token {pct(t.tolerated_tokens, t.wrong_tokens)}")


def make_engine(models, num_steps: int, backend: str) -> SpecEngine:
    spec = SpeculativeConfig(num_steps=num_steps, num_draft_tokens=num_steps + 1)
    return SpecEngine(models.target, models.draft, spec, POOL,
                      GraphConfig(backend=backend, buckets=(1, 2, 4)))


def load_models(dtypes: list[str]) -> dict[tuple[str, str], object]:
    """(trained | random, fp32 | bf16) -> models; bf16 legs also need the fp32 oracle."""
    out = {}
    for dt in sorted(set(dtypes) | {"fp32"}):
        out["trained", dt] = load_checkpoint("builtin:tiny-trained", DTYPES[dt])
        rand = random_models(preset_config("tiny"), 0)
        for module in (rand.target, rand.draft):
            module.to(DTYPES[dt]).eval().requires_grad_(False)
        out["random", dt] = rand
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["both", *DTYPES], default="both")
    ap.add_argument("--delta", type=float, default=BF16_TOLERANCE,
                    help="bf16 tolerance in fp32 logits (default: runtime.tolerance.BF16_TOLERANCE)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtypes = list(DTYPES) if args.dtype == "both" else [args.dtype]
    models = load_models(dtypes)
    rng, engines = random.Random(args.seed), {}
    schedules = dict.fromkeys(dtypes, 0)
    fp32_requests = fp32_mismatches = 0
    tallies = {"trained": Bf16Tally(), "random": Bf16Tally()}
    start = time.time()
    while time.time() - start < args.seconds:
        dt = rng.choice(dtypes)
        key = (rng.choice(["random", "trained"]), dt, rng.choice([1, 2, 3, 5]),
               rng.choice(["eager", "cpu"]))
        if key not in engines:
            engines[key] = make_engine(models[key[:2]], key[2], key[3])
        if dt == "fp32":
            n, bad = check_fp32(rng, engines[key], models[key[0], "fp32"].target)
            fp32_requests, fp32_mismatches = fp32_requests + n, fp32_mismatches + bad
        else:
            check_bf16(rng, engines[key], models[key[0], "bf16"].target,
                       models[key[0], "fp32"].target, tallies[key[0]], args.delta)
        schedules[dt] += 1
    print(f"{sum(schedules.values())} schedules on {len(engines)} engines in "
          f"{time.time() - start:.0f} s: " + ", ".join(f"{n} {d}" for d, n in schedules.items()))
    if schedules.get("fp32"):
        print(f"fp32: spec == plain greedy in {fp32_requests - fp32_mismatches}/{fp32_requests} "
              f"requests")
    if schedules.get("bf16"):
        for model, tally in tallies.items():
            if tally.requests:
                report_bf16(model, tally, args.delta)
    return 1 if fp32_mismatches or any(t.violations for t in tallies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
