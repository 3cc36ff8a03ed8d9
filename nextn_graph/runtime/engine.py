"""The embeddable engine: requests join and leave between rounds.

``add_request`` queues a request; ``step`` admits what the pool can hold
(prefill + draft extend for prefill, eager), then runs one speculative round for
every running request and returns each request's newly committed tokens. A
finished request's pool row goes back at once. Per-request device state lives in
tables indexed by pool row, so a round gathers it with one index tensor and the
only host sync of a round is reading the accepted tokens back.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ..config import GraphConfig, PoolConfig, RunConfig, SpeculativeConfig, resolve_graph
from ..errors import InputError
from ..generate import GenerateResult, validate_prompt, validate_prompts
from ..memory.pool import PoolLayout
from ..model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN
from ..graph.backends import GraphBackend, make_backend
from ..graph.runner import RoundRunner
from ..graph.updates import UpdateRegistry
from . import phases
from .buffers import RequestState, RoundBuffers, RoundPhases
from .stats import SpecStats


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    row: int = 0  # pool request row once admitted (0 = not yet)
    finished: bool = False

    def emit(self, tokens: Iterable[int]) -> list[int]:
        """Append tokens up to a stop token or max_new_tokens; return what was kept."""
        kept = []
        for tok in tokens:
            kept.append(tok)
            if tok in self.stop_ids or len(self.output) + len(kept) >= self.max_new_tokens:
                self.finished = True
                break
        self.output.extend(kept)
        return kept


@dataclass(frozen=True)
class StepOutput:
    rid: int
    new_tokens: list[int]  # committed this step, after stop / length cuts
    finished: bool
    draft_tokens: list[int]  # the candidates proposed this round (empty at prefill)


class SpecEngine:
    def __init__(self, target: DeepseekV4ForCausalLM, draft: DeepseekV4ForCausalLMNextN,
                 spec: SpeculativeConfig | None, pool: PoolConfig,
                 graph: GraphConfig | None = None,
                 backend: GraphBackend | None = None, updates: UpdateRegistry | None = None,
                 progress: bool = False):
        """Start-up in a fixed order: pools, static state and buffers, then capture.

        ``spec`` None decodes plainly (no draft: one target row per request and
        round), over the same buffers and graphs, for like-for-like comparisons.
        ``graph`` None runs eagerly; otherwise its backend (or ``backend``, an
        already-built one, e.g. the NPU adapter over a fake namespace) captures the
        phases of every bucket before the first request.
        """
        self.cfg, self.spec = target.cfg, spec
        self.num_steps = spec.num_steps if spec is not None else 0
        width = self.num_steps + 1
        layout = PoolLayout(pool.max_requests, pool.max_context, width)
        self.max_context = pool.max_context
        self.models = phases.SpecModels(target, draft, target.new_pool(layout),
                                        draft.new_pool(layout))
        self.device = target.embed.weight.device
        dtype = target.embed.weight.dtype
        self.state = RequestState.allocate(layout.rows, self.cfg.hc_dim, self.device, dtype)
        bufs = RoundBuffers.allocate(pool.max_requests, self.num_steps, self.cfg.hc_dim,
                                     self.device, dtype)
        graph = resolve_graph(graph or GraphConfig(backend="eager"), pool, "graph config")
        updates = updates or UpdateRegistry()
        backend = backend or make_backend(graph.backend, updates)
        self.runner = RoundRunner(
            RoundPhases(self.models, self.state, bufs, self.num_steps), backend,
            buckets=graph.buckets if backend.captures else (), kinds=graph.kinds,
            warmup=graph.warmup, debug_check_addresses=graph.debug_check_addresses,
            updates=updates)
        self.runner.capture(progress=progress)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}  # by pool row
        self._next_rid = 0
        self.stats = SpecStats(verify_width=width)

    @classmethod
    def from_config(cls, cfg: RunConfig, progress: bool = False) -> "SpecEngine":
        """Load the config's checkpoint on its device and dtype, build and capture."""
        from ..checkpoint import load_checkpoint  # checkpoint imports the model only

        models = load_checkpoint(cfg.checkpoint, cfg.torch_dtype, cfg.device)
        return cls(models.target, models.draft, cfg.speculative, cfg.pool, cfg.graph,
                   progress=progress)

    # -- requests --------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], max_new_tokens: int,
                    stop_ids: Iterable[int] | None = None) -> int:
        """Queue a request; a bad one raises here and touches no other request."""
        rid = self._next_rid
        prompt = validate_prompt(prompt, self.cfg, self.max_context, max_new_tokens,
                                 f"request {rid}", self.lookahead)
        if stop_ids is not None and not isinstance(stop_ids, (list, tuple, set, frozenset)):
            raise InputError(f"request {rid}: stop_ids must be a collection of token ids, "
                             f"got {stop_ids!r}")
        stops = frozenset([self.cfg.eos_token_id] if stop_ids is None else stop_ids)
        if any(not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < self.cfg.vocab_size for t in stops):
            raise InputError(f"request {rid}: stop token ids {sorted(stops)} must lie in "
                             f"[0, {self.cfg.vocab_size})")
        self._next_rid += 1
        self._waiting.append(Request(rid, prompt, max_new_tokens, stops))
        return rid

    def abort(self, rid: int) -> bool:
        """Drop a request (a client went away): its row returns to the pool at once.

        Returns False when ``rid`` is unknown or already finished. Other requests
        are untouched: their state lives in their own rows.
        """
        for req in list(self._waiting):
            if req.rid == rid:
                self._waiting.remove(req)
                return True
        for row, req in self._running.items():
            if req.rid == rid and not req.finished:
                del self._running[row]
                self.models.target_pool.release(row)
                return True
        return False

    @property
    def lookahead(self) -> int:
        """Positions a verify window writes past a request's last output: S - 1."""
        return max(self.num_steps - 1, 0)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        outs = self._admit()
        mid = time.perf_counter()
        if self._running:
            outs += self._round()
        self.stats.prefill_s += mid - start
        self.stats.round_s += time.perf_counter() - mid
        for row in [r for r, req in self._running.items() if req.finished]:
            del self._running[row]
            self.models.target_pool.release(row)
        return outs

    # -- phases ----------------------------------------------------------------
    @torch.no_grad()
    def _admit(self) -> list[StepOutput]:
        pool = self.models.target_pool
        new = []
        while self._waiting and pool.free_rows:
            req = self._waiting.popleft()
            req.row = pool.alloc()
            new.append(req)
        if not new:
            return []
        bonus, cand1, seed = phases.prefill(self.models, [r.row for r in new],
                                            [r.prompt for r in new], self.device,
                                            with_draft=self.num_steps > 0)
        rows = torch.tensor([r.row for r in new], device=self.device)
        lengths = torch.tensor([len(r.prompt) for r in new], device=self.device)
        self.state.store(rows, lengths, bonus, cand1, seed)
        self.stats.prefill_forwards += 1
        self.stats.nextn_extend_forwards += int(self.num_steps > 0)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in new)
        outs = []
        for req, tok in zip(new, bonus.tolist()):
            self._running[req.row] = req
            kept = req.emit([tok])
            self.stats.emitted_tokens += len(kept)
            outs.append(StepOutput(req.rid, kept, req.finished, []))
        return outs

    @torch.no_grad()
    def _round(self) -> list[StepOutput]:
        active = [req for req in self._running.values() if not req.finished]
        if not active:
            return []
        s, chunks = self.num_steps, self.runner.counters.rounds
        # Committed length on the host: all output but the bonus has target KV.
        res = self.runner.run([r.row for r in active],
                              [len(r.prompt) + len(r.output) - 1 for r in active])
        chunks = self.runner.counters.rounds - chunks
        b = len(active)
        st = self.stats
        st.rounds += 1
        st.request_rounds += b
        st.verify_forwards += chunks
        st.nextn_extend_forwards += chunks * int(s > 0)
        st.nextn_decode_forwards += chunks * max(s - 1, 0)
        st.proposed_drafts += b * s
        st.accepted_drafts += sum(res.accept_lens) - b
        outs = []
        for req, a, preds, drafts in zip(active, res.accept_lens, res.preds, res.drafts):
            kept = req.emit(preds[:a])
            st.emitted_tokens += len(kept)
            outs.append(StepOutput(req.rid, kept, req.finished, drafts))
        return outs

    # -- convenience -----------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop_ids: Iterable[int] | None = None) -> GenerateResult:
        """Run a batch to completion; outputs in prompt order."""
        # All-or-nothing: a bad prompt raises before any request is queued.
        validate_prompts(prompts, self.cfg, self.max_context, max_new_tokens, self.lookahead)
        start = time.perf_counter()
        before = SpecStats(**vars(self.stats))
        replays_before = self.runner.counters.as_dict()
        rids = [self.add_request(p, max_new_tokens, stop_ids) for p in prompts]
        outputs: dict[int, list[int]] = {rid: [] for rid in rids}
        while self.has_work:
            for out in self.step():
                outputs[out.rid].extend(out.new_tokens)
        stats = SpecStats(**{k: v - getattr(before, k) for k, v in vars(self.stats).items()})
        stats.verify_width = self.num_steps + 1
        wall = time.perf_counter() - start
        replays = {k: v - replays_before[k] for k, v in self.runner.counters.as_dict().items()
                   if k not in ("rounds", "real_rows")}
        extra = {"mode": "spec" if self.num_steps else "plain", "num_steps": self.num_steps,
                 "backend": self.runner.backend.name, "wall_s": round(wall, 4),
                 "tokens_per_s": round(stats.emitted_tokens / wall, 2) if wall > 0 else None,
                 **replays}
        return GenerateResult([outputs[r] for r in rids], {**extra, **stats.as_dict()})
