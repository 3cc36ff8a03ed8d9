"""Device specs for the roofline projection: memory bandwidth, matmul peak, and the
least time a kernel takes inside a graph.

A projection, not a measurement: each kernel-launching op of the round is charged
``max(bytes / bandwidth, flops / peak, floor)`` and the charges are summed, as if
every kernel ran at the roofline one after another. Nominal datasheet figures:

- ``h200``: NVIDIA H200 SXM, 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16 tensor cores.
- ``910b``: Ascend 910B, 1.6 TB/s HBM2e and 320 TFLOP/s FP16/BF16 (the nominal
  figures of the 910B3 class; other 910B bins are 10-20 % higher).

``floor_s`` is an assumption, not a datasheet figure: 2 us per kernel on both, what a
small kernel costs inside a captured graph (launch gap, ramp-up and tail). An op that
touches no bytes and does no FLOPs (an allocation, an alias, an empty tensor) is
charged nothing: it issues no device work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import InputError


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    label: str  # what the figures are, for the report
    bandwidth: float  # bytes/s of device memory
    peak_flops: float  # FLOP/s, dense bf16 matmul
    floor_s: float  # least seconds of one kernel in a graph (an assumption)
    backend: str  # cuda | npu: whose kernels the round runs (``kernels.select``)

    def op_seconds(self, nbytes: int, flops: int) -> float:
        """Projected seconds of ONE kernel touching ``nbytes`` and doing ``flops``."""
        if nbytes == 0 and flops == 0:
            return 0.0  # no device work: an allocation or an alias
        return max(nbytes / self.bandwidth, flops / self.peak_flops, self.floor_s)

    def ideal_seconds(self, nbytes: int, flops: int) -> float:
        """Bytes and FLOPs at the roofline with no per-kernel floor."""
        return max(nbytes / self.bandwidth, flops / self.peak_flops)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["floor_us"] = out.pop("floor_s") * 1e6
        return out


DEVICE_SPECS = {
    "h200": DeviceSpec("h200", "NVIDIA H200 SXM (nominal): 4.8 TB/s HBM3e, 989 TFLOP/s dense "
                       "BF16, 2 us floor per kernel (assumed)", 4.8e12, 989e12, 2e-6, "cuda"),
    "910b": DeviceSpec("910b", "Ascend 910B (nominal, 910B3 class): 1.6 TB/s HBM2e, 320 TFLOP/s "
                       "FP16/BF16, 2 us floor per kernel (assumed)", 1.6e12, 320e12, 2e-6, "npu"),
}


def device_spec(name: str) -> DeviceSpec:
    if name not in DEVICE_SPECS:
        raise InputError(f"unknown device spec {name!r}; choose from {sorted(DEVICE_SPECS)}")
    return DEVICE_SPECS[name]
