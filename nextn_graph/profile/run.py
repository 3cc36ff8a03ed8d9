"""``profile_round``: build on meta, count one round, weigh it against the ideal."""

from __future__ import annotations

import time

from ..kernels.registry import decompositions
from ..kernels.select import projected_kernels
from ..model import ModelConfig
from .build import (DTYPE_NAMES, ProfileSettings, build_config, check_settings, count_round,
                    profile_models, decode_round)
from .counter import WorkCounter
from .ideal import ideal_bytes, phase_forwards
from .kinds import KindResolver
from .report import summarize
from .specs import device_spec

ORIGINS = ("preset", "checkpoint", "config")  # where a profiled model config came from
NOTES = (
    "kernels: aten ops that launch a kernel (every dispatched op but pure views, the rule "
    "of the eager submission count), counted on the meta device: the same ops a real "
    "device runs for these shapes. A project op (nextn_graph::) counts as one kernel only "
    "where the device has a kernel for it in this tree (the fused Triton ops on CUDA, "
    "torch._grouped_mm in bf16 on CUDA); elsewhere its decomposition is counted, as that "
    "device runs it (kernels/registry.py): the reference set's quantized GEMMs dequantize "
    "on every device, the Triton set's read the stored bits.",
    "bytes touched: per op, bytes read + written by the rules of nextn_graph.profile."
    "traffic (a tensor's own extent, broadcast dims once; gathers read what they output; "
    "in-place scatters write what they scatter; grouped GEMMs read the groups with rows); "
    "the sparse kernels read their index lists up to the counts a request of context_len "
    "positions has (profile/lengths.py; none given: every list full).",
    "FLOPs: matmul-class only (torch's flop_registry, _grouped_mm and the quantized GEMM "
    "ops); elementwise FLOPs and the sparse kernels' are not counted.",
    "ideal: weights read once per forward, routed experts only the min(E, T*k) a forward "
    "can reach, embedding and hash tables only the T rows looked up; KV reads excluded.",
    "projected ms: a roofline PROJECTION, sum over kernels of max(bytes / bandwidth, FLOPs "
    "/ peak, floor); ideal ms: max(ideal bytes / bandwidth, the round's FLOPs / peak).",
)


def _model_line(cfg: ModelConfig) -> str:
    return (f"{cfg.num_hidden_layers} layers + NextN, {cfg.n_routed_experts} routed experts "
            f"(top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} shared, hidden "
            f"{cfg.hidden_size}, vocab {cfg.vocab_size}")


def profile_round(cfg: ModelConfig, st: ProfileSettings, source: str, top: int = 10,
                  origin: dict | None = None) -> dict:
    """The work profile of one steady round of ``st.bucket`` requests (see the package
    docstring); a JSON-ready dict. ``source`` names the model for the report; ``origin``:
    where it came from (``preset``, ``checkpoint``, ``config``), echoed in ``config``."""
    start = time.perf_counter()
    check_settings(cfg, st)
    spec = device_spec(st.device_spec)
    built_cfg = build_config(cfg, st.max_context)
    kernels = projected_kernels(st.kernels, spec.backend)
    models = profile_models(built_cfg, st.weights, st.dtype, kernels=kernels)
    rnd = decode_round(models, st)
    built = time.perf_counter()
    # an op of the project's with no kernel on the spec's device counts as what it runs
    counter = WorkCounter(KindResolver(), memo=True,
                          decompose=decompositions(spec.backend, st.dtype),
                          length=st.context_len)
    count_round(rnd, st.bucket, counter)
    counted = time.perf_counter()
    out = summarize(counter.work, spec, ideal_bytes(models, st), [str(p) for p in rnd.phases],
                    top, counter.launches)
    out["forwards"] = phase_forwards(st)
    out["config"] = {
        "source": source, **{k: (origin or {}).get(k) for k in ORIGINS},
        "model": _model_line(cfg), "bucket": st.bucket,
        "num_steps": st.num_steps, "verify_width": st.verify_width, "weights": st.weights,
        "dtype": DTYPE_NAMES[st.dtype], "device_spec": st.device_spec,
        "kernels": {"setting": st.kernels, "set": kernels.name},
        "pool": {"max_requests": st.max_requests, "max_context": st.max_context},
        "context_len": st.context_len,
        "round": "split", "sampling": False, "device": "meta",
        "max_position_embeddings": {"config": cfg.max_position_embeddings,
                                    "built": built_cfg.max_position_embeddings},
    }
    out["device_spec"] = spec.as_dict()
    out["notes"] = list(NOTES)
    out["wall_s"] = {"build": built - start, "count": counted - built,
                     "total": time.perf_counter() - start}
    return out
