"""Ahead-of-time builds of the Triton kernels for a GPU this machine need not have.

``compile_for(kernel, signature, constexprs)`` runs Triton's whole pipeline (TTIR,
TTGIR, LLVM IR, PTX, cubin with the ptxas Triton ships) for ``target`` (default an
H200: sm_90a, warp 32) and returns the compiled kernel: a kernel that would not build
on the device fails here, with no GPU present.

Not under ``TRITON_INTERPRET=1``: there ``tl.sum``, ``tl.max`` and every other
``@triton.jit`` helper are interpreted functions the compiler cannot call, and a failed
build leaves Triton's interpreter patches in place for the rest of the process (found
here). ``build_module`` therefore compiles a module's ``BUILDS`` in a fresh interpreter
without it: how the tests, run under the interpreter, build every kernel for sm_90a.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

H200 = ("cuda", 90, 32)  # backend, compute capability, warp size
H200_SHARED_BYTES = 232448  # shared memory one block may use on an H200 (227 KB)


@dataclass(frozen=True)
class Build:
    """One representative build of a kernel: its signature (``{"x_ptr": "*fp32",
    "n": "i32", "BLOCK": "constexpr"}``) and the constexpr values of the launch."""

    kernel: Any  # a @triton.jit function (or its interpreted form)
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4  # as the op launches it

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__


def compile_for(build: Build, target: tuple[str, int, int] = H200):
    """Compile ``build`` for ``target``; returns Triton's CompiledKernel (``.asm``
    holds ``ptx`` and ``cubin``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = build.kernel
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{build.name}: an interpreted kernel (TRITON_INTERPRET is set); "
                           f"build it with build_module, in a process without it")
    src = ASTSource(fn=fn, signature=build.signature, constexprs=build.constexprs)
    return triton.compile(src, target=GPUTarget(*target), options={"num_warps": build.num_warps})


def build_module(module: str, timeout_s: float = 600) -> list[dict]:
    """Compile every ``Build`` of ``module`` (``"nextn_graph.kernels.triton_norm"``) for an
    H200 in a fresh interpreter without ``TRITON_INTERPRET`` -> one dict per build, in
    order: ``name``, ``cubin_bytes``, ``shared_bytes``, ``num_warps``. A build that fails
    raises with the compiler's message."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", __name__, module], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"building {module} for sm_90a failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main(module: str) -> None:
    import importlib
    out = []
    for build in importlib.import_module(module).BUILDS:
        k = compile_for(build)
        out.append({"name": build.name, "cubin_bytes": len(k.asm["cubin"]),
                    "shared_bytes": k.metadata.shared, "num_warps": k.metadata.num_warps})
    print(json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1])
