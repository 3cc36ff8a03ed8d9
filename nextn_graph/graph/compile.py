"""Compiled graphs: one ``torch.compile(fullgraph=True, dynamic=False)`` per graph key.
Dynamo's own ``cudagraphs`` backend is not offered: in torch 2.13 it treats no input as
static when modules are inlined, so every replay would copy every weight and pool.

Each capture gets its own code object (``_entry``): Dynamo caches per code object, at
most ``recompile_limit`` (8) entries, and every ``partial(unit.run, key)`` shares one,
so the ninth capture would fail under ``fullgraph``; raising the limit would make every
replay walk every graph's guards. Every tensor a capture holds is marked static, so
recording backends use it in place instead of copying it into graph-owned inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch

from ..errors import ConfigError
from ..errors import CaptureError

# ``auto`` is resolved by config/graph.py:resolve_compile, on Ascend by torchair_compiler
DYNAMO_BACKENDS = ("inductor", "aot_eager", "reduce-overhead")
TORCHAIR_BACKENDS = ("npugraph_ex", "reduce-overhead")
CUDA_ONLY = ("reduce-overhead",)
# Calls that trace, compile and record a graph. CUDA graph trees run a function's first
# call as a warm-up and record on the second; the third is the first replay.
_GRAPH_TREE_CALLS = 3


@dataclass(frozen=True)
class Compiler:
    label: str  # what logs and errors name: "inductor", "npugraph_ex", ...
    backend: str | Callable  # a registered Dynamo backend name, or a backend callable
    mode: str | None = None  # torch.compile mode (inductor only)
    calls: int = 1  # calls at capture: trace + compile (+ warm-up and record)
    cuda_graphs: bool = False  # inductor must record CUDA graphs: a skip fails the capture

    def compile(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        return torch.compile(fn, backend=self.backend, mode=self.mode, fullgraph=True,
                             dynamic=False)


def dynamo_compiler(name: str) -> Compiler:
    if name == "reduce-overhead":
        return Compiler(name, "inductor", mode="reduce-overhead", calls=_GRAPH_TREE_CALLS,
                        cuda_graphs=True)
    if name in DYNAMO_BACKENDS:
        return Compiler(name, name)
    raise ConfigError(f"graph backend 'compile': compile_backend {name!r} is not one of "
                      f"{('auto',) + DYNAMO_BACKENDS} (npugraph_ex: use graph backend 'torchair')")


def torchair_compiler(choice: str, torchair: Any,
                      lookup: Callable[[str], Callable | None]) -> Compiler:
    """``auto``: npugraph_ex where the installed torch_npu registers it, else torchair's
    reduce-overhead mode. ``lookup(name)``: a registered Dynamo backend or None."""
    if choice not in ("auto",) + TORCHAIR_BACKENDS:
        raise ConfigError(f"graph backend 'torchair': compile_backend {choice!r} is not one of "
                          f"{('auto',) + TORCHAIR_BACKENDS}")
    npugraph_ex = lookup("npugraph_ex")
    if choice == "auto":
        choice = "npugraph_ex" if npugraph_ex is not None else "reduce-overhead"
    if choice == "npugraph_ex":
        if npugraph_ex is None:
            raise ConfigError("graph backend 'torchair': the installed torch_npu registers no "
                              "'npugraph_ex' Dynamo backend; set graph.compile_backend to "
                              "reduce-overhead (or auto), or install a newer torch_npu")
        # inputs are static tensors read in place: torchair's default clone_input=True
        # would copy each one on every replay (torchair configs/npugraphex_config.py)
        return Compiler("npugraph_ex", functools.partial(npugraph_ex,
                                                         options={"clone_input": False}))
    config = torchair.CompilerConfig()
    config.mode = "reduce-overhead"  # aclgraph capture of the compiled FX graph
    config.debug.aclgraph.clone_input = False  # as above: inputs are static, never copied
    return Compiler("torchair reduce-overhead", torchair.get_npu_backend(compiler_config=config))


def _registered_backend(name: str) -> Callable | None:
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        return None
    return torch._dynamo.lookup_backend(name)


def _trampoline(fn: Callable[[], Any]) -> Callable[[], None]:
    def entry() -> None:
        fn()

    return entry


def _entry(fn: Callable[[], Any], name: str) -> types.FunctionType:
    """A function calling ``fn`` on a code object of its own."""
    proto = _trampoline(fn)
    names = {"co_name": name}
    if sys.version_info >= (3, 11):
        names["co_qualname"] = name
    return types.FunctionType(proto.__code__.replace(**names), proto.__globals__, name,
                              None, proto.__closure__)


def _label(fn: Callable) -> str:
    """``round_B4`` (``str(key)``) for the cache's ``partial(unit.run, key)``; logs only."""
    if isinstance(fn, functools.partial) and fn.args:
        return "_B".join(str(a) for a in fn.args)
    return fn.__name__ if isinstance(fn, types.FunctionType) else "graph"


def held_tensors(fn: Callable) -> list[torch.Tensor]:
    """Every tensor ``fn`` reaches outside ``nn.Module``s (not through globals)."""
    seen: set[int] = set()
    found: dict[int, torch.Tensor] = {}
    stack: list[Any] = [fn]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), type,
                                                torch.nn.Module, types.ModuleType)):
            continue
        seen.add(id(obj))
        stack.extend(_children(obj, found))
    return list(found.values())


def _children(obj: Any, found: dict[int, torch.Tensor]) -> Iterator[Any]:
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, functools.partial):
        yield from (obj.func, *obj.args, *obj.keywords.values())
    elif isinstance(obj, types.MethodType):
        yield obj.__self__
        yield obj.__func__
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # an empty cell
                pass
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif isinstance(obj, dict):
        yield from obj.values()
    elif dataclasses.is_dataclass(obj):
        yield from (getattr(obj, f.name) for f in dataclasses.fields(obj))
    elif hasattr(obj, "__dict__"):
        yield from vars(obj).values()


def _cudagraph_skips() -> int:
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


class CompiledGraph:
    """A replay is a call of the compiled function; Dynamo's guards run first."""

    def __init__(self, compiled: Callable[[], Any], code: types.CodeType, label: str,
                 nbytes: int):
        self.compiled, self.code, self.label = compiled, code, label  # code: Dynamo's cache key
        self.nbytes, self.ops, self.update_ops = nbytes, -1, []
        self.replays = 0

    def replay(self, update: list[dict] | None = None) -> None:
        refuse_dispatch_mode(self.label)
        self.compiled()
        self.replays += 1


def refuse_dispatch_mode(label: str) -> None:
    """Dynamo skips a frame entered under a ``TorchDispatchMode`` and, with fullgraph,
    marks its code never to compile, so every later call fails too (torch 2.13): raising
    first fails the step only. Count compiled rounds with ``counting.compiled_counter``."""
    mode = torch.utils._python_dispatch._get_current_dispatch_mode()
    if mode is not None:
        raise RuntimeError(f"compiled graph {label} cannot run under the active "
                           f"TorchDispatchMode {type(mode).__name__}: Dynamo would mark the "
                           f"graph uncompilable for the engine's life; leave the mode first")


class CompileBackend:
    """``device``: ``torch.cuda`` or a ``torch.npu``-like namespace; None on CPU."""

    captures = True

    def __init__(self, compiler: Compiler, name: str = "compile", device: Any = None):
        self.name, self.compiler, self.device = name, compiler, device
        self.captured = 0
        self._capturing = False

    def new_pool(self) -> None:
        return None  # Dynamo's backends own their graphs' memory

    def warmup_context(self) -> ContextManager:
        return nullcontext()

    def capture(self, fn: Callable[[], Any], pool: Any) -> CompiledGraph:
        for tensor in held_tensors(fn):
            torch._dynamo.mark_static_address(tensor)  # guard=False: no data_ptr guard
        label = _label(fn)
        entry = _entry(fn, f"nextn_{label}_{self.captured}")
        compiled = self.compiler.compile(entry)
        before = self._reserved(empty_cache=True)
        skips = _cudagraph_skips()
        refuse_dispatch_mode(label)
        self._capturing = True
        try:
            for _ in range(self.compiler.calls):
                compiled()
        except torch._dynamo.exc.Unsupported as exc:  # a graph break under fullgraph
            raise CaptureError(f"torch.compile ({self.compiler.label}) cannot capture "
                               f"{label} as one graph: {str(exc)[:500]}") from exc
        except torch._dynamo.exc.BackendCompilerFailed as exc:  # e.g. AOT autograd cannot
            # functionalize an op whose output aliases its input (_c10d_functional.all_reduce_)
            raise CaptureError(f"torch.compile ({self.compiler.label}) traced {label} but "
                               f"could not compile it: {str(exc)[:500]}") from exc
        finally:
            self._capturing = False
        if self.compiler.cuda_graphs and _cudagraph_skips() > skips:  # inductor only warns
            raise CaptureError(f"torch.compile ({self.compiler.label}) compiled {label} but "
                               f"recorded no CUDA graph (see the 'skipping cudagraphs' warning)")
        self.synchronize()
        self.captured += 1
        return CompiledGraph(compiled, entry.__code__, label, max(0, self._reserved() - before))

    def _reserved(self, empty_cache: bool = False) -> int:
        """Reserved, not allocated: memory_allocated misses a graph's private pool."""
        if self.device is None:
            return 0
        self.device.synchronize()
        if empty_cache:  # cached free blocks would hide or inflate the growth
            self.device.empty_cache()
        return self.device.memory_reserved()

    def is_capturing(self) -> bool:
        if self._capturing:
            return True
        return bool(self.device is not None and self.device.is_current_stream_capturing())

    def synchronize(self) -> None:
        if self.device is not None:
            self.device.synchronize()


def dynamo_backend(compile_backend: str = "auto") -> CompileBackend:
    name = "inductor" if compile_backend == "auto" else compile_backend
    compiler = dynamo_compiler(name)
    if name in CUDA_ONLY and not torch.cuda.is_available():
        raise ConfigError(f"graph backend 'compile': compile_backend {name!r} records CUDA "
                          f"graphs and needs a CUDA device; none is available")
    return CompileBackend(compiler, "compile", torch.cuda if torch.cuda.is_available() else None)


def torchair_backend(compile_backend: str = "auto", namespace: Any = None,
                     torchair: Any = None, lookup: Callable[[str], Callable | None] | None = None
                     ) -> CompileBackend:
    """torch_npu is imported here, so a machine without it fails at start-up naming it.
    ``namespace``, ``torchair`` and ``lookup`` stand in for the real ones in CPU tests."""
    if torchair is None:
        from .npu import _import_torch_npu  # lazy: torch_npu breaks `import torch` without CANN

        npu = _import_torch_npu()
        namespace = namespace if namespace is not None else npu
        import torchair as torchair_module  # ships inside torch_npu

        torchair = torchair_module
    compiler = torchair_compiler(compile_backend, torchair, lookup or _registered_backend)
    return CompileBackend(compiler, "torchair", namespace)
