"""The engines a bench measures, built once from the config: one per mode.

Speculative and plain decoding, each eager and on the config's graph backend;
where the config's round is fused, the same speculative round split in three
graphs (``round: split``, as SGLang) and fused with overlap on; with
``bench.compile_peer``, speculative decoding on ``torch.compile``d graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import RunConfig, compile_peer, resolve_graph
from ..runtime.engine import SpecEngine


@dataclass
class Engines:
    """The engines a bench measures, by mode name. With the eager backend there are no
    graphs to compare, so only the two eager engines exist (a "graph" engine would be a
    second eager run whose ratios are noise). ``graph_*`` are the config's graph engines
    (fused with overlap off, where the config's round is fused); ``split_spec`` and
    ``overlap_spec`` exist only then: the same speculative round split in three graphs,
    and fused with overlap on (where overlap can work: not on NPU graphs)."""
    eager_spec: SpecEngine
    eager_plain: SpecEngine
    graph_spec: SpecEngine | None
    graph_plain: SpecEngine | None
    compile_spec: SpecEngine | None = None  # the compile peer (bench.compile_peer)
    split_spec: SpecEngine | None = None
    overlap_spec: SpecEngine | None = None

    @property
    def has_graphs(self) -> bool:
        return self.graph_spec is not None

    @property
    def spec(self) -> SpecEngine:
        """The speculative engine on the config's backend: what the headline figures use."""
        return self.graph_spec if self.graph_spec is not None else self.eager_spec

    @property
    def plain(self) -> SpecEngine:
        return self.graph_plain if self.graph_plain is not None else self.eager_plain

    @property
    def fused(self) -> bool:
        """The config's graph round is one fused graph (else split, or no graphs)."""
        return self.graph_spec is not None and self.graph_spec.chunks.round.fused

    def split_mode(self) -> str | None:
        """The mode name of the split-graph speculative engine, if any."""
        return "split_spec" if self.fused else ("graph_spec" if self.has_graphs else None)

    def traced_modes(self) -> set[str]:
        """The mode names whose steady rounds are traced (``trace.record_trace``): the fused
        round with overlap off and on, where the config's round is fused."""
        return {"graph_spec", "overlap_spec"} if self.fused else set()

    def by_name(self) -> dict[str, SpecEngine]:
        return {name: e for name, e in vars(self).items() if e is not None}


def build_engines(models, cfg: RunConfig, progress: bool) -> Engines:
    # eager keeps its phases apart (the bench counts and times each); the config's round
    # was resolved for its graph backend
    eager = replace(cfg.graph, backend="eager", round="split", overlap="off")

    def engine(spec, graph, **kwargs) -> SpecEngine:
        return SpecEngine(models.target, models.draft, spec, cfg.pool, graph, **kwargs)

    graphs = cfg.graph.backend != "eager"
    # The config's graph engines run without overlap (a fused round's overlap is its own
    # mode below; a split round has none), so graph and plain compare like for like.
    graph = replace(cfg.graph, overlap="off")
    peer = compile_peer(cfg)
    # Only the config's own engines sample (the sampled end-to-end pair); the other modes
    # are greedy, so they skip the sampling graphs' capture.
    greedy = {"sampling": False}
    engines = Engines(
        eager_spec=engine(cfg.speculative, eager), eager_plain=engine(None, eager),
        graph_spec=engine(cfg.speculative, graph, progress=progress) if graphs else None,
        graph_plain=engine(None, graph, progress=progress) if graphs else None,
        compile_spec=(engine(cfg.speculative, replace(peer, overlap="off", **greedy),
                             progress=progress) if peer else None))
    if engines.fused:
        engines.split_spec = engine(cfg.speculative, replace(graph, round="split", **greedy),
                                    progress=progress)
        # overlap only where it can work (not on NPU graphs, which take host lengths)
        overlap = replace(graph, overlap="auto")
        if resolve_graph(overlap, cfg.pool, "bench").overlap == "on":
            engines.overlap_spec = engine(cfg.speculative,
                                          replace(overlap, overlap="on", **greedy),
                                          progress=progress)
    return engines
