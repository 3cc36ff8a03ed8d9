"""The EAGLE speculative runtime (topk 1) against the no-cache oracle.

Every speculative output is compared token for token with ``reference_generate``
(full recompute, no cache), directly or through ``plain_generate`` where speed
matters. Two model pairs: the shipped ``builtin:tiny-trained`` checkpoint, whose
NextN draft really predicts the target (acceptance length ~2.6 at depth 3, so
multi-token chunks, stop cuts inside a chunk and draft/target alignment are
exercised), and the random ``tiny`` fixture (acceptance ~1: almost every round
commits only the target's bonus token).

The tiny preset has a sliding window of 16, C4 blocks of 4 positions and C128
blocks of 128 positions; prompt lengths below sit on both sides of each.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from nextn_graph.cli import main
from nextn_graph.config import PoolConfig, SpeculativeConfig
from nextn_graph.errors import InputError
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.oracle import reference_candidates

from helpers import corpus_prompts, random_prompt

REPO = Path(__file__).resolve().parents[2]
STATS_KEYS = {"rounds", "target_forwards", "nextn_extend_forwards", "nextn_decode_forwards",
              "proposed_drafts", "accepted_drafts", "acceptance_length",
              "draft_acceptance_rate"}


_REF: dict[tuple, list[int]] = {}


def reference(target, prompt: list[int], max_new: int) -> list[int]:
    """The oracle's output with no stop tokens, memoised per (model, prompt).

    Greedy decoding without stops is prefix-closed: the answer for a smaller
    max_new is a prefix of the one for a larger max_new.
    """
    key = (target, tuple(prompt))  # the module itself: an id could be reused
    have = _REF.get(key)
    if have is None or len(have) < max_new:
        have = reference_generate(target, [prompt], max_new, stop_ids=set(),
                                  max_context=len(prompt) + max_new).outputs[0]
        _REF[key] = have
    return have[:max_new]


def engine(models, num_steps: int, max_requests: int = 8, max_context: int = 192) -> SpecEngine:
    return SpecEngine(models.target, models.draft,
                      SpeculativeConfig(num_steps=num_steps, num_draft_tokens=num_steps + 1),
                      PoolConfig(max_requests, max_context))


def drive(eng: SpecEngine, max_steps: int = 400):
    """step() until idle -> (outputs by rid, list of every step's StepOutputs)."""
    outputs: dict[int, list[int]] = defaultdict(list)
    steps = []
    while eng.has_work:
        assert len(steps) < max_steps, "engine did not finish"
        outs = eng.step()
        steps.append(outs)
        for out in outs:
            outputs[out.rid].extend(out.new_tokens)
    return outputs, steps


# -- 1. lossless -------------------------------------------------------------------------

# 1 and 4: decode crosses C4 boundaries; 15/16/17: prefill around the window of 16;
# 33 and 64: past several C4 blocks; 125: decode crosses the first C128 block at 128.
BATCH_LENGTHS = [1, 4, 15, 16, 17, 33, 64, 125]
BATCH_NEW = 14


def lossless_prompts() -> tuple[list[list[int]], list[int]]:
    corpus = corpus_prompts(3, BATCH_LENGTHS)
    # Alternate corpus and random tokens; keep the 125-token prompt from the corpus so
    # its long chunks cross position 127 inside accepted chains on the trained model.
    batch = [p if i % 2 == 0 or n == 125 else random_prompt(n, 100 + i)
             for i, (p, n) in enumerate(zip(corpus, BATCH_LENGTHS))]
    single = corpus_prompts(0, [9])[0]
    return batch, single


@pytest.mark.parametrize("model", ["trained", "tiny"])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 5])
def test_lossless_against_reference(model, num_steps, request):
    """Speculative greedy output equals the no-cache reference token for token, for
    num_steps 1, 2, 3 and 5, for one request alone and for eight together, with
    corpus and random prompts whose lengths straddle the SWA window (16), C4 blocks
    and the first C128 block (a 125-token prompt decoded to position 138), on the
    trained checkpoint (multi-token chunks) and on random weights (acceptance ~1)."""
    models = request.getfixturevalue(model)
    batch, single = lossless_prompts()

    res = engine(models, num_steps).generate(batch, BATCH_NEW, stop_ids=[])
    expected = [reference(models.target, p, BATCH_NEW) for p in batch]
    assert [len(o) for o in res.outputs] == [BATCH_NEW] * len(batch)
    assert res.outputs == expected

    one = engine(models, num_steps, max_requests=1, max_context=64).generate([single], 30,
                                                                             stop_ids=[])
    assert one.outputs == [reference(models.target, single, 30)]

    if model == "trained" and num_steps >= 2:
        # The case is real: chains of several accepted drafts were committed.
        assert res.stats["acceptance_length"] > 1.5
        assert one.stats["acceptance_length"] > 1.5


def test_exact_fit_context_and_tiny_pool(trained):
    """A request with prompt + max_new_tokens + lookahead == max_context exactly (the
    last verify window writes the pool's last position) still equals the reference,
    including C4/C128 entries at the pool's end, next to another request's row."""
    s = 3
    prompts = corpus_prompts(5, [40, 21])
    max_context = 64
    new = [max_context - len(p) - (s - 1) for p in prompts]  # 22 and 41
    eng = engine(trained, s, max_requests=2, max_context=max_context)
    rids = [eng.add_request(p, n, stop_ids=[]) for p, n in zip(prompts, new)]
    outputs, _ = drive(eng)
    for rid, p, n in zip(rids, prompts, new):
        assert outputs[rid] == reference(trained.target, p, n)
    with pytest.raises(InputError, match="lookahead"):
        eng.add_request(prompts[0], new[0] + 1)


# -- 2. continuous batching --------------------------------------------------------------

def test_requests_join_and_leave_between_rounds(trained):
    """Requests added after a few steps join running ones, requests with smaller
    max_new_tokens leave early (one finishes at its prefill), and every request's
    concatenated new_tokens equal its reference output."""
    eng = engine(trained, 3, max_requests=4)
    prompts = corpus_prompts(11, [12, 30, 7, 20, 45])
    limits = [6, 36, 1, 10, 18]
    rids = [eng.add_request(p, n, stop_ids=[]) for p, n in zip(prompts[:3], limits[:3])]
    outputs: dict[int, list[int]] = defaultdict(list)
    steps: list[dict[int, object]] = []

    def step():
        outs = eng.step()
        steps.append({o.rid: o for o in outs})
        for o in outs:
            outputs[o.rid].extend(o.new_tokens)

    for _ in range(3):
        step()
    assert outputs[rids[2]] == reference(trained.target, prompts[2], 1)  # done at prefill
    assert rids[2] not in steps[1]  # and gone from later rounds
    late = [eng.add_request(p, n, stop_ids=[]) for p, n in zip(prompts[3:], limits[3:])]
    rids += late
    while eng.has_work:
        assert len(steps) < 200
        step()
    for rid, p, n in zip(rids, prompts, limits):
        assert outputs[rid] == reference(trained.target, p, n), f"request {rid}"
    # The late ones joined while request 1 (36 tokens) was still decoding, and
    # request 0 (6 tokens) left while others continued.
    join = next(i for i, s in enumerate(steps) if late[0] in s)
    assert join == 3 and rids[1] in steps[join] and not steps[join][rids[1]].finished
    leave = next(i for i, s in enumerate(steps) if rids[0] in s and s[rids[0]].finished)
    assert any(rids[1] in s for s in steps[leave + 1:])
    assert all(rids[0] not in s for s in steps[leave + 1:])


def test_pool_rows_are_reused_and_nobody_starves(trained, monkeypatch):
    """With 2 pool rows and 5 requests, admission waits (num_waiting > 0 while both
    rows are busy), a finished request's row is handed to a later request, requests
    are admitted in arrival order, and all five finish with the reference output."""
    eng = engine(trained, 3, max_requests=2)
    pool = eng.models.target_pool
    allocated: list[int] = []  # pool rows in the order they were handed out
    real_alloc = pool.alloc

    def alloc(positions: int | None = None, shared=()) -> int:
        allocated.append(real_alloc(positions, shared))
        return allocated[-1]

    monkeypatch.setattr(pool, "alloc", alloc)
    prompts = corpus_prompts(12, [10, 25, 5, 17, 33])
    limits = [4, 20, 7, 12, 3]
    rids = [eng.add_request(p, n, stop_ids=[]) for p, n in zip(prompts, limits)]
    admitted: list[int] = []
    outputs: dict[int, list[int]] = defaultdict(list)
    waited = steps = 0
    while eng.has_work:
        steps += 1
        assert steps < 200
        outs = eng.step()
        for o in outs:
            outputs[o.rid].extend(o.new_tokens)
            if not o.draft_tokens and o.rid not in admitted:  # its prefill output
                admitted.append(o.rid)
        if eng.num_waiting:
            waited += 1
            # Only wait while every row is busy: the rows of this step's finished
            # requests are freed at its end and refilled at the next step's start.
            assert pool.free_rows == sum(o.finished for o in outs)
    assert waited > 0
    assert admitted == rids  # FIFO admission, nobody overtaken
    assert len(allocated) == 5 and set(allocated) == {1, 2}  # rows were reused
    for rid, p, n in zip(rids, prompts, limits):
        assert outputs[rid] == reference(trained.target, p, n), f"request {rid}"
    assert pool.free_rows == 2 and not eng.has_work


# -- 3. stop tokens and max_new_tokens inside an accepted chain -------------------------

def find_long_chunk(models, num_steps: int):
    """A (prompt, outputs before the round, chunk) with a chunk of >= 3 tokens whose
    2nd token appears nowhere earlier in the output."""
    for seed in range(20):
        prompt = corpus_prompts(20 + seed, [14])[0]
        eng = engine(models, num_steps, max_requests=1, max_context=96)
        eng.add_request(prompt, 40, stop_ids=[])
        before: list[int] = []
        while eng.has_work:
            for out in eng.step():  # the first step: prefill output, then a round
                chunk = out.new_tokens
                if out.draft_tokens and len(chunk) >= 3 and chunk[1] not in before + chunk[:1]:
                    return prompt, before, chunk
                before = before + chunk
    raise AssertionError("no round with an accept length >= 3 found")


@pytest.mark.parametrize("num_steps", [3, 5])
def test_stop_token_inside_accepted_chain(trained, num_steps):
    """A stop token that is the 2nd token of a round's committed chunk (accept length
    >= 3) ends the request right after it: the output equals the reference cut after
    the first occurrence of the stop token, and the round really committed more
    tokens than were kept."""
    prompt, before, chunk = find_long_chunk(trained, num_steps)
    stop = chunk[1]
    full = reference(trained.target, prompt, 40)
    expected = full[: full.index(stop) + 1]
    assert len(expected) == len(before) + 2
    direct = reference_generate(trained.target, [prompt], 40, stop_ids={stop}).outputs[0]
    assert direct == expected

    eng = engine(trained, num_steps, max_requests=1, max_context=96)
    eng.add_request(prompt, 40, stop_ids=[stop])
    outputs, steps = drive(eng)
    assert outputs[0] == expected
    last = steps[-1][0]
    assert last.finished and last.new_tokens == chunk[:2]
    # The drafts that made the chunk long were accepted in this very round...
    assert last.draft_tokens[:2] == chunk[:2]
    # ...and the stats count more committed tokens than were handed back.
    st = eng.stats
    committed = st.prefill_forwards + st.accepted_drafts + st.request_rounds
    assert committed == st.emitted_tokens + len(chunk) - 2 > st.emitted_tokens


@pytest.mark.parametrize("num_steps", [3, 5])
def test_max_new_tokens_inside_accepted_chain(trained, num_steps):
    """max_new_tokens falling inside a round's committed chunk of >= 3 tokens cuts the
    output to exactly max_new_tokens, equal to the reference's prefix, although that
    round committed more tokens than were kept."""
    prompt, before, chunk = find_long_chunk(trained, num_steps)
    for keep in (1, 2):
        max_new = len(before) + keep
        eng = engine(trained, num_steps, max_requests=1, max_context=96)
        res = eng.generate([prompt], max_new, stop_ids=[])
        direct = reference_generate(trained.target, [prompt], max_new, stop_ids=set())
        assert len(res.outputs[0]) == max_new
        assert res.outputs == direct.outputs
        assert res.outputs[0] == (before + chunk)[:max_new]
        st = res.stats
        committed = st["prefill_forwards"] + st["accepted_drafts"] + st["request_rounds"]
        assert committed == st["emitted_tokens"] + len(chunk) - keep
        assert st["emitted_tokens"] == max_new


# -- 4. draft alignment ------------------------------------------------------------------

def test_draft_candidates_equal_the_oracle(trained):
    """Every round's proposed candidates equal reference_candidates (full recompute of
    target hidden states and the NextN chain) for committed = prompt + output before
    the round minus its last token and bonus = that last token; over 3 concurrent
    requests (one joining mid-flight) at num_steps 3, with many accepted drafts."""
    s = 3
    eng = engine(trained, s, max_requests=3, max_context=96)
    prompts = corpus_prompts(0, [13, 21]) + corpus_prompts(4, [18])
    limits = [24, 30, 20]
    reqs = {eng.add_request(p, n, stop_ids=[]): p for p, n in zip(prompts[:2], limits[:2])}
    outputs: dict[int, list[int]] = defaultdict(list)
    checked = accepted_rounds = 0
    steps = 0
    while eng.has_work:
        if steps == 2:
            reqs[eng.add_request(prompts[2], limits[2], stop_ids=[])] = prompts[2]
        steps += 1
        for out in eng.step():
            if out.draft_tokens:
                before = outputs[out.rid]
                committed = reqs[out.rid] + before[:-1]
                want = reference_candidates(trained.target, trained.draft, committed,
                                            before[-1], s)
                assert out.draft_tokens == want, (out.rid, len(before))
                checked += 1
                if len(out.new_tokens) > 1:
                    assert out.draft_tokens[: len(out.new_tokens) - 1] == out.new_tokens[:-1]
                    accepted_rounds += 1
            outputs[out.rid].extend(out.new_tokens)
    assert checked >= 15
    assert accepted_rounds >= 5
    for rid, p in reqs.items():
        assert outputs[rid] == reference(trained.target, p, limits[rid])


# -- 5. counts ---------------------------------------------------------------------------

def test_counts_per_round_num_steps_3(trained):
    """num_steps 3, topk 1: after prefill each steady round adds 2 NextN decode, 1 NextN
    extend and 1 target (verify) forward and 3*B proposed drafts; each request gets 1..4
    tokens and 3 candidates per round, its chunk being the greedy chain (accepted
    drafts, then the target's token); the derived figures follow from the counters, and
    the trained draft reaches acceptance length >= 2."""
    eng = engine(trained, 3, max_requests=4)
    prompts = corpus_prompts(0, [10, 20, 30])
    for p in prompts:
        eng.add_request(p, 60, stop_ids=[])
    first = eng.step()  # admission (prefill + extend for prefill) and the first round
    st = eng.stats
    assert (st.prefill_forwards, st.verify_forwards, st.rounds) == (1, 1, 1)
    assert st.nextn_extend_forwards == 2 and st.nextn_decode_forwards == 2
    assert len(first) == 6  # 3 prefill outputs + 3 round outputs
    accepted = 0
    for _ in range(8):
        before = dict(vars(st))
        outs = eng.step()
        b = len(outs)
        assert b == 3 and not any(o.finished for o in outs)
        delta = {k: v - before[k] for k, v in vars(st).items()}
        assert delta["nextn_decode_forwards"] == 2
        assert delta["nextn_extend_forwards"] == 1
        assert delta["verify_forwards"] == 1 and delta["prefill_forwards"] == 0
        assert delta["rounds"] == 1 and delta["request_rounds"] == b
        assert delta["proposed_drafts"] == 3 * b
        for o in outs:
            n = len(o.new_tokens)
            assert 1 <= n <= 4 and len(o.draft_tokens) == 3
            assert o.draft_tokens[: n - 1] == o.new_tokens[: n - 1]
            if n < 4:
                assert o.draft_tokens[n - 1] != o.new_tokens[n - 1]
            accepted += n - 1
        assert delta["accepted_drafts"] == sum(len(o.new_tokens) - 1 for o in outs)
        assert delta["emitted_tokens"] == sum(len(o.new_tokens) for o in outs)
    assert st.target_forwards == st.prefill_forwards + st.verify_forwards

    res = engine(trained, 3).generate(corpus_prompts(1, [16, 40]), 40, stop_ids=[])
    d = res.stats
    assert STATS_KEYS <= set(d)
    assert d["acceptance_length"] == pytest.approx(
        (d["accepted_drafts"] + d["request_rounds"]) / d["request_rounds"], abs=1e-4)
    assert d["draft_acceptance_rate"] == pytest.approx(
        d["accepted_drafts"] / d["proposed_drafts"], abs=1e-4)
    assert d["proposed_drafts"] == 3 * d["request_rounds"]
    assert d["nextn_decode_forwards"] == 2 * d["rounds"]
    assert d["nextn_extend_forwards"] == d["rounds"] + d["prefill_forwards"]
    assert d["target_forwards"] == d["rounds"] + d["prefill_forwards"]
    assert d["acceptance_length"] >= 2.0
    assert d["emitted_tokens"] == 80


def test_counts_num_steps_1(trained):
    """num_steps 1: one candidate per request-round from draft extend alone, no rollout
    decode calls at all, verify window 2, 1..2 tokens per round."""
    eng = engine(trained, 1)
    prompts = corpus_prompts(2, [12, 25])
    res = eng.generate(prompts, 20, stop_ids=[])
    d = res.stats
    assert d["nextn_decode_forwards"] == 0
    assert d["nextn_extend_forwards"] == d["rounds"] + d["prefill_forwards"]
    assert d["proposed_drafts"] == d["request_rounds"]
    assert d["verify_width"] == 2
    assert res.outputs == [reference(trained.target, p, 20) for p in prompts]
    eng.add_request(prompts[0], 6, stop_ids=[])
    eng.step()
    outs = eng.step()
    assert all(len(o.draft_tokens) == 1 and 1 <= len(o.new_tokens) <= 2 for o in outs)


# -- 6. bad input ------------------------------------------------------------------------

def test_bad_requests_do_not_disturb_running_ones(trained):
    """While requests run, add_request with an empty prompt, an out-of-vocabulary token,
    prompt + max_new_tokens + lookahead over max_context (the message names the
    lookahead), max_new_tokens 0 or bad stop ids raises InputError, queues nothing, and
    the running requests still produce the reference output."""
    eng = engine(trained, 3, max_requests=4, max_context=64)
    prompts = corpus_prompts(6, [11, 23])
    rids = [eng.add_request(p, 24, stop_ids=[]) for p in prompts]
    outputs: dict[int, list[int]] = defaultdict(list)
    for _ in range(2):
        for o in eng.step():
            outputs[o.rid].extend(o.new_tokens)
    good = prompts[0]
    bad_calls = [
        (([], 4), {}, "empty prompt"),
        (([5, 256, 7], 4), {}, "outside the vocabulary"),
        (([5, -1], 4), {}, "outside the vocabulary"),
        ((good, 64 - len(good) - 1), {}, "lookahead"),  # fits without the 2 lookahead
        ((good, 0), {}, "max_new_tokens"),
        ((good, 4), {"stop_ids": [-1]}, "stop token"),
        ((good, 4), {"stop_ids": [256]}, "stop token"),
        ((good, 4), {"stop_ids": ["7"]}, "stop token"),
    ]
    for args, kw, msg in bad_calls:
        with pytest.raises(InputError, match=msg):
            eng.add_request(*args, **kw)
        assert eng.num_waiting == 0
    while eng.has_work:
        for o in eng.step():
            outputs[o.rid].extend(o.new_tokens)
    for rid, p in zip(rids, prompts):
        assert outputs[rid] == reference(trained.target, p, 24)


def test_generate_is_all_or_nothing(trained):
    """generate with one bad prompt among good ones raises before queuing anything, and
    a later generate on the same engine works and equals the reference."""
    eng = engine(trained, 2, max_requests=2, max_context=64)
    good = corpus_prompts(8, [9, 14])
    with pytest.raises(InputError, match="request 2: empty prompt"):
        eng.generate([*good, []], 10, stop_ids=[])
    assert eng.num_waiting == 0 and not eng.has_work
    with pytest.raises(InputError, match="request 0"):
        eng.generate([good[0] + [300]], 10, stop_ids=[])
    assert eng.num_waiting == 0
    res = eng.generate(good, 10, stop_ids=[])
    assert res.outputs == reference_generate(trained.target, good, 10, stop_ids=set()).outputs


# -- 7. CLI ------------------------------------------------------------------------------

@pytest.mark.heavy
def test_cli_spec_equals_reference(tmp_path, capsys, trained):
    """`generate --checkpoint builtin:tiny-trained --json` runs the speculative mode by
    default and prints the same output_ids as --mode reference, with the speculative
    stats; `--config capture_configs/cpu_default.yaml` works without --checkpoint."""
    prompts = corpus_prompts(9, [6, 18, 31]) + [random_prompt(12, 3)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))

    def run(*extra: str) -> dict:
        rc = main(["generate", "--prompts", str(path), "--max-new-tokens", "16", "--json",
                   *extra])
        out = capsys.readouterr()
        assert rc == 0, out.err
        return json.loads(out.out)

    spec = run("--checkpoint", "builtin:tiny-trained")
    ref = run("--checkpoint", "builtin:tiny-trained", "--mode", "reference")
    cfg = run("--config", str(REPO / "capture_configs" / "cpu_default.yaml"))
    outs = [r["output_ids"] for r in ref["requests"]]
    assert spec["stats"]["mode"] == "spec" and ref["stats"]["mode"] == "reference"
    assert [r["output_ids"] for r in spec["requests"]] == outs
    assert [r["output_ids"] for r in cfg["requests"]] == outs
    assert [r["input_ids"] for r in spec["requests"]] == prompts
    assert STATS_KEYS <= set(spec["stats"]) and STATS_KEYS <= set(cfg["stats"])
    assert spec["stats"]["num_steps"] == 3
    assert spec["stats"]["acceptance_length"] > 1.5
    # Independent of the CLI: the default stop (eos) reference in-process agrees.
    assert outs == reference_generate(trained.target, prompts, 16).outputs


@pytest.mark.parametrize("stops", [3, [True], "7"])
def test_stop_ids_must_be_token_ids(tiny, stops):
    """stop_ids must be a collection of int token ids: a bare int, a bool or a string
    is an InputError naming the request, not a TypeError or a silent token 1."""
    engine = SpecEngine(tiny.target, tiny.draft, SpeculativeConfig(), PoolConfig(2, 128))
    with pytest.raises(InputError, match="request 0: stop"):
        engine.add_request([5, 6, 7], 4, stop_ids=stops)
    assert engine.num_waiting == 0
