"""The profiled round: target and draft built on the ``meta`` device (no memory), their
KV pools and the round's static buffers, as ``SpecEngine`` builds them.

``SpecEngine`` itself cannot run on ``meta`` (it reads the accepted tokens back to the
host), so the profile drives ``DecodeRound`` directly: split (rollout, target verify,
draft extend as three phases), greedy, one steady round of a bucket of B requests in
pool rows 1..B.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..checkpoint.loader import LoadedModel, _swap_linear, build_models, expected_state
from ..checkpoint.save import _FP4_KEY, _FP8_KEY
from ..config import MAX_NUM_STEPS, WEIGHTS_MODES
from ..errors import ConfigError, InputError
from ..kernels.select import REFERENCE, Kernels, projected_kernels
from ..memory.pool import PoolLayout
from ..model import ModelConfig
from ..model.ops import use_kernels
from ..runtime.buffers import RequestState, RoundBuffers
from ..runtime.models import SpecModels
from ..graph.kinds import GraphKey
from ..runtime.round import DecodeRound
from .counter import WorkCounter
from .specs import device_spec

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


@dataclass(frozen=True)
class ProfileSettings:
    bucket: int = 1  # B: request rows of the round
    num_steps: int = 3  # S (0: plain decoding, the target alone)
    max_requests: int = 8  # pool rows (row 0, padding, comes on top)
    max_context: int = 8192  # positions per request row of the pool
    weights: str = "dequantized"  # or "quantized": the release's FP8 / FP4 linears
    dtype: torch.dtype = torch.bfloat16  # the model's and the pools' dtype
    device_spec: str = "h200"  # see specs.DEVICE_SPECS
    kernels: str = "auto"  # auto | reference | triton: the set the spec's device would run
    # positions each request has cached, for the ops whose work follows it (None: the
    # worst case, every index list full; ``lengths.py``)
    context_len: int | None = None

    @property
    def verify_width(self) -> int:
        """N = S + 1 (1 for plain decoding)."""
        return self.num_steps + 1


def check_settings(cfg: ModelConfig, st: ProfileSettings) -> None:
    """Refuse settings no round can have, naming the value."""
    if not 1 <= st.bucket <= st.max_requests:
        raise InputError(f"profile: bucket {st.bucket} must lie in [1, max_requests "
                         f"{st.max_requests}] (the pool's request rows)")
    if not 0 <= st.num_steps <= MAX_NUM_STEPS:
        raise InputError(f"profile: num_steps {st.num_steps} must lie in [0, {MAX_NUM_STEPS}]")
    if st.max_context < st.verify_width + 1:
        raise InputError(f"profile: max_context {st.max_context} is smaller than one verify "
                         f"window ({st.verify_width}) plus a prompt token")
    if st.max_context > cfg.max_position_embeddings:
        raise InputError(f"profile: max_context {st.max_context} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    if st.context_len is not None and not 1 <= st.context_len <= st.max_context - st.verify_width:
        raise InputError(f"profile: context_len {st.context_len} must lie in [1, max_context "
                         f"{st.max_context} - verify width {st.verify_width}] (the round "
                         f"writes its window after it)")
    if st.weights not in WEIGHTS_MODES:
        raise InputError(f"profile: weights {st.weights!r} must be one of {WEIGHTS_MODES}")
    if st.dtype not in DTYPE_NAMES:
        raise InputError(f"profile: dtype {st.dtype} must be one of "
                         f"{sorted(DTYPE_NAMES.values())}")
    try:
        projected_kernels(st.kernels, device_spec(st.device_spec).backend)
    except ConfigError as exc:
        raise InputError(f"profile: {exc}") from None


def build_config(cfg: ModelConfig, max_context: int) -> ModelConfig:
    """The config the model is built from: ``max_position_embeddings`` cut to the pool's
    ``max_context``. The RoPE tables (one per kind of layer) are built on the host at
    that length even on ``meta`` (V4-Flash: 2 x 1M positions, ~512 MB and seconds of
    float64 work); no position of the round exceeds the pool, and the rows do not depend
    on the table's length (YaRN reads ``original_max_position_embeddings``), so the
    tables the round reads are the same."""
    if max_context >= cfg.max_position_embeddings:
        return cfg
    return dataclasses.replace(cfg, max_position_embeddings=max_context)


def quantized_plan(models: LoadedModel) -> dict[str, str]:
    """Linear module path -> 'fp8' | 'fp4' for every weight the release stores
    quantized (``checkpoint._FP8_KEY``: attention, shared experts, NextN projections;
    ``_FP4_KEY``: routed experts)."""
    plan = {}
    for key in expected_state(models):
        fmt = "fp4" if _FP4_KEY.search(key) else ("fp8" if _FP8_KEY.search(key) else None)
        if fmt is not None:
            plan[key.removesuffix(".weight")] = fmt
    return plan


def profile_models(cfg: ModelConfig, weights: str, dtype: torch.dtype,
                   device: str = "meta", kernels: Kernels = REFERENCE) -> LoadedModel:
    """Target and draft in ``dtype`` on ``device`` (``meta``: no memory; a real device
    only to check the count, with uninitialised weights). ``weights="quantized"`` swaps
    the release's FP8 / FP4 linears into ``QuantLinear`` as the loader does (e8m0
    scales). ``kernels``: the set both models run."""
    with torch.device(device):
        models = build_models(cfg)  # refuses a model the host cannot hold, unless on meta
        if weights == "quantized":
            for base, fmt in quantized_plan(models).items():
                _swap_linear(models, base, fmt, fp32_scale=False)
    for module in (models.target, models.draft):
        # host-built tables (RoPE, the FP4 values) move to the device too; modules that
        # keep derived tensors (stacked experts) rebuild them in their _apply
        module.to(device=device, dtype=dtype).eval().requires_grad_(False)
        use_kernels(module, kernels)
    return models


def decode_round(models: LoadedModel, st: ProfileSettings) -> DecodeRound:
    """Pools, request state and round buffers as ``SpecEngine`` allocates them, on the
    models' device, with the bucket's requests staged in pool rows 1..B (copy 0)."""
    target, draft = models.target, models.draft
    device, dtype = target.embed.weight.device, target.embed.weight.dtype
    layout = PoolLayout(st.max_requests, st.max_context, st.verify_width)
    m = SpecModels(target, draft, target.new_pool(layout), draft.new_pool(layout))
    state = RequestState.allocate(layout.rows, models.cfg.hc_dim, device, dtype)
    bufs = RoundBuffers.allocate(st.max_requests, st.num_steps, models.cfg.hc_dim, device,
                                 dtype)
    bufs.slots[:st.bucket].copy_(torch.arange(1, st.bucket + 1, device=device))
    return DecodeRound(m, state, bufs, st.num_steps)


def count_round(rnd: DecodeRound, bucket: int, counter: WorkCounter) -> None:
    """Run each phase of one round once under ``counter``, marked by its phase."""
    with torch.no_grad(), counter:
        for phase in rnd.phases:
            with counter.phase(str(phase)):
                rnd.run(GraphKey(phase, bucket))
