"""Tensor parallelism end to end (gloo on CPU): the engine on 2 and 4 ranks equals tp = 1.

Every check spawns real ranks (``launch.ranks.spawn``): rank 0 drives the engine,
the others follow it (``launch.follower.serve``). Tokens must equal the tp = 1 run
for plain, speculative eager and speculative on the ``cpu`` graph backend, over
schedules with joins, leaves, stops and a bucket split. A killed or hung rank must
end the others with an error within the configured timeout.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from nextn_graph.checkpoint import load_checkpoint, random_models
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.errors import ParallelError
from nextn_graph.model.config import config_from_dict
from nextn_graph.launch.follower import mirror, serve, shutdown
from nextn_graph.parallel.group import TPGroup
from nextn_graph.launch.ranks import spawn
from nextn_graph.checkpoint.presets import TINY
from nextn_graph.runtime.engine import SpecEngine

from helpers import corpus_prompts, random_prompt
from test_graph_runtime import Req, grow_and_shrink, run_schedule

pytestmark = pytest.mark.process  # tensor-parallel groups of spawned ranks

TRAINED = "builtin:tiny-trained"
# pages of 128 positions, 4 for 6 rows: admission waits for pages, rank 0's page ids
# (reused, out of order) reach the followers' page tables in the prefill message
POOL = PoolConfig(max_requests=6, max_context=256, page_size=128, num_pages=4)
GRAPHS = GraphConfig(backend="cpu", buckets=(1, 2, 4))
EAGER = GraphConfig(backend="eager")
# tiny widths that divide by 4: heads 8, o_groups 4, index heads 4, experts 8
TP4 = {**TINY, "num_attention_heads": 8, "o_groups": 4, "index_n_heads": 4,
       "n_routed_experts": 8}


def _random_schedule(gen: torch.Generator, seed: int) -> list[Req]:
    """Up to 6 requests: random arrivals, lengths, corpus or uniform tokens, limits."""
    out = []
    for i in range(int(torch.randint(1, 7, (1,), generator=gen))):
        at, n, max_new = (int(v) for v in torch.randint(0, 30, (3,), generator=gen))
        prompt = (corpus_prompts(seed + i, [n % 25 + 3])[0] if i % 2
                  else random_prompt(n % 25 + 1, seed + i))
        out.append(Req(at % 5, prompt, max_new % 20 + 1))
    return out


def schedules(seed: int) -> list[list[Req]]:
    """The grow-and-shrink schedule (joins, a split above bucket 4, a stop, a 1-token
    request), then random ones."""
    gen = torch.Generator().manual_seed(seed)
    return [grow_and_shrink(seed)] + [_random_schedule(gen, seed + 10 * k) for k in range(4)]


MODES = {"plain": (None, EAGER), "spec_eager": (SpeculativeConfig(num_steps=3), EAGER),
         "spec_graphs": (SpeculativeConfig(num_steps=3), GRAPHS)}


def _models(group: TPGroup, preset: dict | None):
    if preset is None:
        return load_checkpoint(TRAINED, tp=group)
    return random_models(config_from_dict(dict(preset), "test"), 0, tp=group)


def run_modes(group: TPGroup, preset: dict | None, modes: list[str], seed: int,
              count: int = 5):
    """Every mode over every schedule -> {mode: [outputs per schedule]} (rank 0), plus
    the reference decoding of the first schedule (mirrored on every rank)."""
    torch.set_num_threads(1)
    models = _models(group, preset)
    if not group.is_driver:
        return serve(models, group)
    with torch.no_grad():
        out = {}
        for mode in modes:
            spec, graph = MODES[mode]
            eng = SpecEngine(models.target, models.draft, spec, POOL, graph)
            out[mode] = [run_schedule(eng, s).outputs for s in schedules(seed)[:count]]
            out[f"{mode}_collectives"] = eng.tp.counts.as_dict()
            out[f"{mode}_graph_collectives"] = eng.chunks.counters.graph_collectives
        out["sampled"] = _sampled(group, models, seed)
        first = schedules(seed)[0]
        out["reference"] = mirror(group, models, "reference_generate",
                                  [r.prompt for r in first], max(r.max_new for r in first),
                                  stop_ids=set()).outputs
    shutdown(group)
    return out


def _sampled(group: TPGroup, models, seed: int) -> dict:
    """Seeded sampling (greedy beside it): speculative on the graphs, plain eager, and the
    mirrored oracle (seeds given, so every rank draws the same)."""
    prompts = corpus_prompts(seed, [6, 11, 17, 9])
    smp = [{"temperature": 1.0, "seed": 1}, None, {"temperature": 0.7, "top_k": 6, "seed": 2},
           {"temperature": 1.2, "top_p": 0.9, "seed": 3}]
    out = {}
    for mode in ("plain", "spec_graphs"):
        spec, graph = MODES[mode]
        eng = SpecEngine(models.target, models.draft, spec, POOL, graph)
        out[mode] = eng.generate(prompts, 14, stop_ids=[], sampling=smp).outputs
    out["reference"] = mirror(group, models, "reference_generate", prompts, 14,
                              stop_ids=set(), sampling=smp).outputs
    return out


def test_tp2_tokens_equal_tp1_plain_spec_eager_and_graphs():
    """tp = 2 on the trained checkpoint: plain, speculative eager and speculative on the
    cpu graphs give exactly tp = 1's tokens over five schedules; collectives ran
    (eagerly and inside the replayed graphs) and one control message per round."""
    modes = list(MODES)
    got = spawn(run_modes, 2, (None, modes, 5), timeout_s=120)[0]
    want = run_modes(TPGroup.single(), None, modes, 5)
    for mode in modes:
        assert got[mode] == want[mode], mode
        assert want[f"{mode}_collectives"]["all_reduce"] == 0  # tp = 1 issues none
        assert got[f"{mode}_collectives"]["control"] > 0
    assert got["spec_eager_collectives"]["all_reduce"] > 0
    assert got["spec_graphs_graph_collectives"] > 0
    assert got["reference"] == want["reference"]
    # seeded sampling: the same draws on 2 ranks as on 1; plain rounds draw the oracle's
    assert got["sampled"] == want["sampled"]
    assert want["sampled"]["plain"] == want["sampled"]["reference"]
    # and the reference is what the engines decoded (truncated to each request's limit)
    first = schedules(5)[0]
    for i, r in enumerate(first):
        assert want["spec_graphs"][0][i] == want["reference"][i][:r.max_new], i


def run_prefix(group: TPGroup):
    """Waves of shared-prefix prompts on a prefix-cached engine (rank 0) -> by prompt:
    (tokens, accepted per round, cached tokens)."""
    from test_prefix_cache import WAVES, _prompts, _serve
    torch.set_num_threads(1)
    models = load_checkpoint(TRAINED, tp=group)
    if not group.is_driver:
        return serve(models, group)
    with torch.no_grad():
        eng = SpecEngine(models.target, models.draft, SpeculativeConfig(num_steps=3),
                         PoolConfig(4, 512, page_size=128, num_pages=16, prefix_cache=True),
                         GRAPHS)
        out = _serve(eng, _prompts(), WAVES)
    shutdown(group)
    return out


def test_tp2_prefix_cache_hits_equal_tp1():
    """The followers restore, snapshot and seed as rank 0 says (the prefill message):
    tp = 2 with prefix hits gives tp = 1's tokens, drafts and hits."""
    got = spawn(run_prefix, 2, (), timeout_s=120)[0]
    want = run_prefix(TPGroup.single())
    assert got == want
    assert sum(c for _, _, c in want.values()) > 0


def run_grow(group: TPGroup):
    """Pages on demand with preemptions (rank 0) -> (tokens, preemptions)."""
    from test_preemption import _engine, _run, LENGTHS
    torch.set_num_threads(1)
    models = load_checkpoint(TRAINED, tp=group)
    if not group.is_driver:
        return serve(models, group)
    with torch.no_grad():
        eng = _engine(models, GRAPHS)
        out = _run(eng, corpus_prompts(8, LENGTHS)), eng.stats.preemptions
    shutdown(group)
    return out


def test_tp2_pages_grow_and_preemptions_equal_tp1():
    """Rank 0 grows the page tables before a round (a GrowTables message) and preempts:
    tp = 2 gives tp = 1's tokens."""
    got = spawn(run_grow, 2, (), timeout_s=120)[0]
    want = run_grow(TPGroup.single())
    assert got == want and want[1] > 0


@pytest.mark.slow
def test_tp4_tokens_equal_tp1():
    """tp = 4 on a tiny variant whose heads, groups, indexer heads and experts divide by 4:
    every mode over the grow-and-shrink schedule. Slow (about 85 s on 2 cores): 4 ranks
    share the cores and every collective waits for all four to be scheduled. CI runs it
    (.ci/run), beside the default run."""
    modes = list(MODES)
    got = spawn(run_modes, 4, (TP4, modes, 9, 1), timeout_s=180)[0]
    want = run_modes(TPGroup.single(), TP4, modes, 9, 1)
    for mode in modes:
        assert got[mode] == want[mode], mode


# -- a rank that dies or hangs ----------------------------------------------------------

TIMEOUT_S = 4


def kill_one(group: TPGroup, victim: int, hang: bool, out_dir: str):
    """Rank 0 drives requests; ``victim`` is killed after two rounds (SIGKILL from rank
    0, or, with ``hang``, it stops answering). Each surviving rank writes what happened
    to ``out_dir/rank{r}`` (spawn cannot return it when a rank is gone)."""
    torch.set_num_threads(1)
    models = load_checkpoint(TRAINED, tp=group)
    pids = group.agree("pids", os.getpid())
    report = os.path.join(out_dir, f"rank{group.rank}")
    if group.rank == victim and hang:  # follows the build, admission and 2 rounds, then
        recv, seen = group.channel.recv, []  # stays alive but silent

        def stalling():
            seen.append(1)
            if len(seen) > 4:
                time.sleep(2 * TIMEOUT_S + 1)
                os._exit(0)
            return recv()
        group.channel.recv = stalling
    if not group.is_driver:
        start = time.monotonic()
        try:
            serve(models, group)
            text = "served to the end"
        except ParallelError as exc:
            text = f"error after {time.monotonic() - start:.1f}s: {exc}"
        with open(report, "w") as f:
            f.write(text)
        return text
    eng = SpecEngine(models.target, models.draft, SpeculativeConfig(num_steps=3), POOL, EAGER)
    rids = [eng.add_request(p, 60, stop_ids=[]) for p in corpus_prompts(3, [10, 14, 20])]
    for _ in range(2):
        eng.step()
    if victim != 0 and not hang:
        os.kill(pids[victim], signal.SIGKILL)
    if victim == 0:
        os._exit(0)  # rank 0 goes away between rounds
    start = time.monotonic()
    failed = {}
    while len(failed) < len(rids):
        for o in eng.step():
            if o.error:
                failed[o.rid] = o.error
    elapsed = time.monotonic() - start
    try:
        eng.step()
        after = "a later step ran"
    except ParallelError:
        after = "later steps refused"
    with open(report, "w") as f:
        f.write(f"failed {sorted(failed)} after {elapsed:.1f}s ({after}): "
                f"{next(iter(failed.values()))}")
    os._exit(0)  # the group is broken: no orderly teardown


@pytest.mark.parametrize("victim,hang", [(1, False), (1, True), (0, False)])
def test_a_lost_rank_ends_the_others_within_the_timeout(tmp_path, victim, hang):
    """A follower killed mid-run, a follower that hangs, rank 0 killed: every surviving
    rank ends with an error naming the failure within the timeout (plus start-up
    slack), and rank 0 fails every request explicitly rather than hanging."""
    with pytest.raises(ParallelError):
        spawn(kill_one, 2, (victim, hang, str(tmp_path)), timeout_s=TIMEOUT_S)
    survivor = 1 - victim
    text = (tmp_path / f"rank{survivor}").read_text()
    if survivor == 0:
        assert text.startswith("failed [0, 1, 2]"), text
        assert "(later steps refused)" in text and "tensor-parallel rank 0" in text
    else:
        assert text.startswith("error after"), text
        assert "lost rank 0" in text
    seconds = float(text.split("after ")[1].split("s")[0])
    assert seconds < TIMEOUT_S + 3, text
