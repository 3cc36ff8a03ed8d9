"""The embeddable engine: requests join and leave between rounds. A fault in a unit of
work (the step's prefill, or one chunk of a round) fails exactly that unit's requests;
an interrupt commits nothing of the round and propagates.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

from ..checkpoint.loader import load_checkpoint
from ..config import GraphConfig, PoolConfig, RunConfig, SchedulerConfig, SpeculativeConfig
from ..errors import InputError, ParallelError, RequestFailed
from ..kernels.select import select_kernels
from ..parallel.group import TPGroup
from ..parallel.messages import BuildEngine
from .generate import GenerateResult
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
from .setup import WHERE, EngineSetup
from .stats import SpecStats


class SpecEngine:
    def __init__(self, target: DeepseekV4ForCausalLM, draft: DeepseekV4ForCausalLMNextN,
                 spec: SpeculativeConfig | None, pool: PoolConfig,
                 graph: GraphConfig | None = None,
                 backend: GraphBackend | None = None, updates: UpdateRegistry | None = None,
                 progress: bool = False, scheduler: SchedulerConfig | None = None,
                 kernels: str | None = None):
        """Start-up in a fixed order: every section resolved (nothing built yet), the
        group told, kernels, pools, static state and buffers, capture, then scheduling.
        ``spec`` None decodes plainly (no draft) over the same buffers and graphs;
        ``graph`` None runs eagerly; ``backend``: a prebuilt one (e.g. NPU over a fake
        namespace); ``kernels`` None keeps the set the models were loaded with."""
        setup = EngineSetup.resolve(target.cfg, spec, pool, graph, scheduler)
        self._join_group(target.tp, setup, kernels,
                         prebuilt=backend is not None or updates is not None)
        self._use_kernels(target, draft, kernels)
        self._pools(target, draft, setup)
        decode = self._state_and_buffers(setup)
        self._graphs(setup, decode, backend, updates or UpdateRegistry(), progress)
        self._scheduling(setup, decode)
        self.request_limits = self._limits(setup)

    def _join_group(self, tp: TPGroup, setup: EngineSetup, kernels: str | None,
                    prebuilt: bool) -> None:
        """On a tensor-parallel group every rank builds the same engine, in the same
        order: rank 0 says which before anything is built."""
        self.tp: TPGroup = tp
        self.engine_id = 0  # on a tensor-parallel group: the same on every rank
        if not tp.parallel:
            return
        if prebuilt:
            raise InputError(f"{WHERE}: a prebuilt graph backend or update registry cannot "
                             f"be mirrored on the other ranks of a tensor-parallel group; "
                             f"give graph.backend instead")
        self.engine_id = tp.channel.new_engine_id()
        if tp.is_driver:
            tp.channel.send(BuildEngine(self.engine_id, setup.spec, setup.pool, setup.graph,
                                        kernels))

    @staticmethod
    def _use_kernels(target: DeepseekV4ForCausalLM, draft: DeepseekV4ForCausalLMNextN,
                     kernels: str | None) -> None:
        if kernels is not None:  # before anything is built over the models
            kernel_set = select_kernels(kernels, target.embed.weight.device.type)
            use_kernels(target, kernel_set)
            use_kernels(draft, kernel_set)

    def _pools(self, target: DeepseekV4ForCausalLM, draft: DeepseekV4ForCausalLMNextN,
               setup: EngineSetup) -> None:
        """What the engine reads off the models and the setup; both models' KV pools, of
        one layout."""
        self.cfg, self.spec = target.cfg, setup.spec
        self.num_steps, self.verify_width = setup.num_steps, setup.verify_width
        self.device = target.embed.weight.device
        self.models = SpecModels(target, draft, target.new_pool(setup.layout),
                                 draft.new_pool(setup.layout))

    def _state_and_buffers(self, setup: EngineSetup) -> DecodeRound:
        """The static state, round buffers and (where the graph section asks) sampling
        and penalty tables, allocated once -> the round over them."""
        rows, requests, g = setup.layout.rows, setup.pool.max_requests, setup.graph
        hc, vocab = self.cfg.hc_dim, self.cfg.vocab_size
        dtype = self.models.target.embed.weight.dtype
        self.state = RequestState.allocate(rows, hc, self.device, dtype)
        bufs = RoundBuffers.allocate(requests, self.num_steps, hc, self.device, dtype,
                                     top_logprobs=g.logprobs)
        sampling = SamplingTables.allocate(rows, requests, self.num_steps, vocab,
                                           self.device) if g.sampling else None
        penalties = PenaltyTables.allocate(rows, vocab, self.verify_width,
                                           self.device) if g.penalties else None
        return DecodeRound(self.models, self.state, bufs, self.num_steps,
                           fused=g.round == "fused", sampling=sampling, penalties=penalties)

    def _graphs(self, setup: EngineSetup, decode: DecodeRound, backend: GraphBackend | None,
                updates: UpdateRegistry, progress: bool) -> None:
        """The graph runner and the round's chunks, captured."""
        g = setup.graph
        backend = backend or make_backend(g.backend, updates, compile_backend=g.compile_backend)
        self.runner = GraphRunner(backend, warmup=g.warmup, collectives=self.tp.counts)
        self.chunks = ChunkRunner(decode, self.runner, g.buckets if backend.captures else (),
                                  g.captured_phases, updates, g.debug_check_addresses)
        self.chunks.capture(progress=progress and self.tp.is_driver)

    def _scheduling(self, setup: EngineSetup, decode: DecodeRound) -> None:
        """The scheduler (rank 0's alone decides), the prefix cache, prefill and rounds."""
        pool, width = setup.pool, setup.verify_width
        self.stats = SpecStats(verify_width=width)
        self.prefix = prefix_reuse(self.models, WHERE) if pool.prefix_cache else None
        self.scheduler = Scheduler(self.models.target_pool, self.stats,
                                   setup.scheduler.prefill_token_budget,
                                   self.tp.rank if self.tp.parallel else None, setup.lookahead,
                                   self.prefix if self.tp.is_driver else None, width,
                                   grow=pool.allocation == "grow")
        # by prefix-cache snapshot, the target's hidden state before its boundary
        hidden = (torch.zeros(setup.layout.snapshots + 1, self.cfg.hc_dim, device=self.device,
                              dtype=self.state.seed.dtype) if pool.prefix_cache else None)
        self.prefill = Prefiller(self.models, self.state, decode.sampling, self.stats,
                                 self.scheduler, self.tp, self.engine_id, self.num_steps,
                                 decode.penalties, hidden)
        self.rounds = RoundDriver(self.chunks, self.stats, self.scheduler, self.tp,
                                  self.engine_id, overlap=setup.overlap)

    def _limits(self, setup: EngineSetup) -> RequestLimits:
        """What a request may ask: its context is bounded by the pool's pages too (all
        of them, at most), so ``max_context`` is what ``add_request`` accepts."""
        pages = self.models.target_pool.pages  # None: nothing paged (no compressed layer)
        g = setup.graph
        return RequestLimits.of(self.cfg, setup.pool.max_context,
                                pages=pages.num_pages if pages is not None else 0,
                                page_size=setup.pool.page_size, lookahead=setup.lookahead,
                                max_logprobs=g.logprobs, samples=g.sampling,
                                penalizes=g.penalties)

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
