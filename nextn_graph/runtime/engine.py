"""The embeddable engine: requests join and leave between rounds. A fault in a unit of
work (the step's prefill, or one chunk of a round) fails exactly that unit's requests;
an interrupt commits nothing of the round and propagates.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

from ..checkpoint.loader import load_checkpoint
from ..config import (GraphConfig, PoolConfig, RunConfig, SchedulerConfig, SpeculativeConfig,
                      check_pool, check_scheduler, check_section, resolve_graph,
                      resolve_speculative)
from ..errors import InputError, ParallelError, RequestFailed
from ..kernels.select import select_kernels
from ..parallel.control import Message
from ..parallel.group import TPGroup
from .generate import GenerateResult
from ..memory.pool import PoolLayout
from ..model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN
from ..model.ops import use_kernels
from ..graph.backends import GraphBackend, make_backend
from ..graph.runner import GraphRunner
from ..graph.updates import UpdateRegistry
from .buffers import RequestState, RoundBuffers, SamplingTables
from .chunks import ChunkRunner
from .driver import RoundDriver
from .penalty_tables import PenaltyTables
from .models import SpecModels
from .prefill import Prefiller
from .prefix_reuse import prefix_reuse
from .round import DecodeRound
from .request import StepOutput
from .request_checks import NewRequest, RequestLimits, checked_batch
from ..sampling import SamplingParams
from .scheduler import Scheduler
from .stats import SpecStats


# pool.prefix_snapshots 0: one boundary state per request row. A state is the SWA
# window and C4's raw block of every layer (V4-Flash: ~6 MB, 3x a page's entries, half a
# row's rings), so one per page would quadruple a long-context pool; more is a setting
# (perf/paged_capacity.py --snapshots-per-row prices it).
DEFAULT_SNAPSHOTS_PER_ROW = 1


class SpecEngine:
    def __init__(self, target: DeepseekV4ForCausalLM, draft: DeepseekV4ForCausalLMNextN,
                 spec: SpeculativeConfig | None, pool: PoolConfig,
                 graph: GraphConfig | None = None,
                 backend: GraphBackend | None = None, updates: UpdateRegistry | None = None,
                 progress: bool = False, scheduler: SchedulerConfig | None = None,
                 kernels: str | None = None):
        """Start-up in a fixed order: pools, static state and buffers, then capture.
        ``spec`` None decodes plainly (no draft) over the same buffers and graphs;
        ``graph`` None runs eagerly; ``backend``: a prebuilt one (e.g. NPU over a fake
        namespace); ``kernels`` None keeps the set the models were loaded with."""
        # Configs built in code are checked as strictly as those read from YAML.
        where = "SpecEngine"
        # rank 0 alone schedules: checked before the other ranks are told to build
        sched_cfg = check_section(scheduler or SchedulerConfig(), where, "scheduler.")
        check_scheduler(sched_cfg, where)
        self.tp: TPGroup = target.tp
        self.engine_id = 0  # on a tensor-parallel group: the same on every rank
        if self.tp.parallel:
            if backend is not None or updates is not None:
                raise InputError("SpecEngine: a prebuilt graph backend or update registry "
                                 "cannot be mirrored on the other ranks of a tensor-parallel "
                                 "group; give graph.backend instead")
            # Every rank builds the same engine, in the same order: rank 0 says which.
            self.engine_id = self.tp.channel.new_engine_id()
            if self.tp.is_driver:
                self.tp.channel.send(Message("build", self.engine_id,
                                             (spec, pool, graph, kernels)))
        if kernels is not None:  # before anything is built over the models
            kernel_set = select_kernels(kernels, target.embed.weight.device.type)
            use_kernels(target, kernel_set)
            use_kernels(draft, kernel_set)
        if spec is not None:
            spec = resolve_speculative(check_section(spec, where, "speculative."), where)
        self.cfg, self.spec = target.cfg, spec
        self.num_steps = spec.num_steps if spec is not None else 0
        self.verify_width = width = spec.verify_width if spec is not None else 1
        pool = check_section(pool, where, "pool.")
        check_pool(pool, width, where)
        graph = resolve_graph(check_section(graph or GraphConfig(backend="eager"), where,
                                            "graph."), pool, where)
        snapshots = 0 if not pool.prefix_cache else (  # the page-boundary states kept
            pool.prefix_snapshots or DEFAULT_SNAPSHOTS_PER_ROW * pool.max_requests)
        layout = PoolLayout(pool.max_requests, pool.max_context, width, pool.page_size,
                            pool.num_pages, snapshots)
        self.max_context = pool.max_context
        # positions a verify window writes past a request's last output: S - 1, and N
        # more with overlap (the round launched before the request's end was read)
        overlap = graph.overlap == "on"
        self.lookahead = max(self.num_steps - 1, 0) + (width if overlap else 0)
        self.models = SpecModels(target, draft, target.new_pool(layout), draft.new_pool(layout))
        # a request's context is bounded by the pool's pages too (all of them, at most)
        self.max_context = min(self.max_context, self.models.target_pool.max_positions)
        self.device = target.embed.weight.device
        dtype = target.embed.weight.dtype
        self.state = RequestState.allocate(layout.rows, self.cfg.hc_dim, self.device, dtype)
        if graph.logprobs > self.cfg.vocab_size:
            raise InputError(f"{where}: graph.logprobs {graph.logprobs} exceeds the "
                             f"vocabulary ({self.cfg.vocab_size} tokens)")
        self.max_logprobs = graph.logprobs  # top logprobs a request may ask per token
        bufs = RoundBuffers.allocate(pool.max_requests, self.num_steps, self.cfg.hc_dim,
                                     self.device, dtype, top_logprobs=graph.logprobs)
        self.samples = graph.sampling  # requests may sample (tables and graphs for it)
        self.penalizes = graph.penalties  # requests may carry penalties
        sampling = SamplingTables.allocate(layout.rows, pool.max_requests, self.num_steps,
                                           self.cfg.vocab_size, self.device) if self.samples else None
        penalties = PenaltyTables.allocate(layout.rows, self.cfg.vocab_size, width,
                                           self.device) if graph.penalties else None
        updates = updates or UpdateRegistry()
        backend = backend or make_backend(graph.backend, updates,
                                          compile_backend=graph.compile_backend)
        self.runner = GraphRunner(backend, warmup=graph.warmup, collectives=self.tp.counts)
        decode = DecodeRound(self.models, self.state, bufs, self.num_steps,
                             fused=graph.round == "fused", sampling=sampling,
                             penalties=penalties)
        self.chunks = ChunkRunner(decode, self.runner,
                                  graph.buckets if backend.captures else (), graph.captured_phases,
                                  updates, graph.debug_check_addresses)
        self.chunks.capture(progress=progress and self.tp.is_driver)
        self.stats = SpecStats(verify_width=width)
        self.prefix = prefix_reuse(self.models, where) if pool.prefix_cache else None
        self.scheduler = Scheduler(self.models.target_pool, self.stats,
                                   sched_cfg.prefill_token_budget,
                                   self.tp.rank if self.tp.parallel else None, self.lookahead,
                                   self.prefix if self.tp.is_driver else None, width,
                                   grow=pool.allocation == "grow")
        hidden = (torch.zeros(layout.snapshots + 1, self.cfg.hc_dim, device=self.device,
                              dtype=dtype) if pool.prefix_cache else None)
        self.prefill = Prefiller(self.models, self.state, sampling, self.stats, self.scheduler,
                                 self.tp, self.engine_id, self.num_steps, penalties, hidden)
        self.rounds = RoundDriver(self.chunks, self.stats, self.scheduler, self.tp,
                                  self.engine_id, overlap=overlap)
        self.request_limits = RequestLimits(self.cfg, self.max_context, self.lookahead,
                                            self.max_logprobs, self.samples, self.penalizes)

    @classmethod
    def from_config(cls, cfg: RunConfig, progress: bool = False) -> "SpecEngine":
        models = load_checkpoint(cfg.checkpoint, cfg.torch_dtype, cfg.device, cfg.weights,
                                 kernels=cfg.kernels)
        return cls(models.target, models.draft, cfg.speculative, cfg.pool, cfg.graph,
                   progress=progress, scheduler=cfg.scheduler)

    def add_request(self, prompt: Sequence[int], max_new_tokens: int,
                    stop_ids: Iterable[int] | None = None,
                    sampling: SamplingParams | dict | None = None,
                    logprobs: int | None = None, prompt_logprobs: int | None = None) -> int:
        """Queue a request; a bad one raises here and touches no other request.
        ``logprobs`` / ``prompt_logprobs`` k (at most graph.logprobs): each output /
        prompt token's raw target logprob and its k most likely; None: off."""
        self._check_alive()
        return self._queue(NewRequest(prompt, max_new_tokens, stop_ids, sampling, logprobs,
                                      prompt_logprobs).checked(
            self.request_limits, f"request {self.scheduler.next_rid}"))

    def _check_alive(self) -> None:
        if self.scheduler.broken:
            raise ParallelError(f"tensor parallelism: this engine's group failed "
                                f"({self.scheduler.broken}); it takes no more requests")

    def _queue(self, req: NewRequest) -> int:
        """A checked request into the scheduler's queue -> its rid."""
        return self.scheduler.add(req.prompt, req.max_new_tokens, req.stop_ids, req.sampling,
                                  req.logprobs, req.prompt_logprobs)

    def abort(self, rid: int) -> bool:
        """Drop a request: its row returns to the pool at once and ``step()`` returns
        nothing more for it. False when ``rid`` is unknown or already finished."""
        return self.scheduler.abort(rid)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.rounds.inflight)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def step(self) -> list[StepOutput]:
        """Every output made since the last return (an interrupted step's included)."""
        sched = self.scheduler
        if sched.broken and not sched.outbox:  # its failures were returned already
            raise ParallelError(f"tensor parallelism: this engine's group failed "
                                f"({sched.broken}); every request was failed")
        start = time.perf_counter()
        self.prefill.step()
        mid = time.perf_counter()
        if sched.running or self.rounds.inflight:
            self.rounds.run()
        self.stats.prefill_s += mid - start
        self.stats.round_s += time.perf_counter() - mid
        return sched.take_outputs()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop_ids: Iterable[int] | None = None,
                 sampling: object = None) -> GenerateResult:
        """Run a batch to completion on an idle engine; outputs in prompt order. Raises
        ``RequestFailed`` (with the partial result) when a fault failed any request."""
        if self.has_work:
            raise InputError(f"generate() runs a batch on an idle engine; this one has "
                             f"{self.scheduler.num_in_flight} requests in flight "
                             f"(drive them with step())")
        # All-or-nothing: a bad request raises before any is queued.
        requests = checked_batch(prompts, max_new_tokens, stop_ids, sampling,
                                 self.request_limits)
        start = time.perf_counter()
        before, counters_before = self.stats.snapshot(), self.chunks.counters.snapshot()
        self._check_alive()
        rids = [self._queue(r) for r in requests]  # (checked above, once)
        index = {rid: i for i, rid in enumerate(rids)}
        outputs: list[list[int]] = [[] for _ in rids]
        errors: dict[int, str] = {}  # by prompt index
        while self.has_work:
            for out in self.step():
                outputs[index[out.rid]].extend(out.new_tokens)
                if out.error is not None:
                    errors[index[out.rid]] = out.error
        stats = self.stats.since(before)
        wall = time.perf_counter() - start
        replays = {k: v for k, v in self.chunks.counters.since(counters_before).as_dict().items()
                   if k not in ("chunks", "real_rows")}
        extra = {"mode": "spec" if self.num_steps else "plain", "num_steps": self.num_steps,
                 "backend": self.runner.backend.name, "wall_s": round(wall, 4),
                 "tokens_per_s": round(stats.emitted_tokens / wall, 2) if wall > 0 else None,
                 **replays}
        result = GenerateResult(outputs, {**extra, **stats.as_dict()})
        if errors:
            i, reason = next(iter(errors.items()))
            raise RequestFailed(f"{len(errors)} of {len(rids)} requests failed "
                                f"(prompt {i}: {reason})", errors, result)
        return result
