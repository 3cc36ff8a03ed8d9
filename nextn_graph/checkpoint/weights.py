"""The safetensors files of a checkpoint directory: which files, what they hold.

A directory holds one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. ``scan`` reads every file's header only (names,
dtypes, shapes: no data), refusing both layouts at once, a listed shard that is
missing, a ``*.safetensors`` the layout does not name, and a tensor in another
shard than the index says. ``Shards`` reads tensors, or one rank's slice of them, with
positioned reads.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from ..textfile import parse_json, read_text

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype names -> torch dtypes (what a header may say)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "F8_E8M0": torch.float8_e8m0fnu, "F4": torch.float4_e2m1fn_x2}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file's header describes it."""
    file: str  # file name in the checkpoint directory
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of an index: tensor name -> shard file name in the same dir."""
    raw = parse_json(read_text(index, "index", CheckpointError), str(index), CheckpointError)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: not a safetensors index ('weight_map' must map "
                              f"tensor names to shard file names)")
    for name in set(weight_map.values()):
        # a shard is a plain file of this directory: no paths that escape it
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise CheckpointError(f"{index}: shard name {name[:80]!r} is not a "
                                  f"*.safetensors file name in this directory")
    return weight_map


def weight_files(root: Path) -> tuple[dict[str, str] | None, list[str]]:
    """The index's weight map (None for a single file) and the files to read."""
    index, single = root / INDEX_FILE, root / SINGLE_FILE
    if index.is_file() and single.is_file():
        raise CheckpointError(f"{root}: both {INDEX_FILE} and {SINGLE_FILE} are present; "
                              f"a checkpoint directory must hold one layout, not both")
    if index.is_file():
        weight_map = _read_index(index)
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        raise CheckpointError(f"{index}: shard {missing[0]} is listed but missing")
    stray = sorted(p.name for p in root.glob("*.safetensors") if p.name not in files)
    if stray:
        named_by = INDEX_FILE if weight_map is not None else SINGLE_FILE
        raise CheckpointError(f"{root}: {stray[:5]} not part of the checkpoint named by "
                              f"{named_by} (stale shards of an earlier write?)")
    return weight_map, files


@contextlib.contextmanager
def _opened(path: Path) -> Iterator:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from None


def scan(root: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint, from the file headers (no tensor data is read)."""
    weight_map, files = weight_files(root)
    infos: dict[str, TensorInfo] = {}
    for name in files:
        path = root / name
        with _opened(path) as f:
            for key in f.keys():
                if weight_map is not None and weight_map.get(key) != name:
                    raise CheckpointError(f"{path}: tensor {key!r} is not listed for this "
                                          f"shard in {INDEX_FILE}")
                view = f.get_slice(key)
                dtype = DTYPES.get(view.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{path}: tensor {key!r} has dtype "
                                          f"{view.get_dtype()}, which this library cannot read")
                infos[key] = TensorInfo(name, dtype, tuple(view.get_shape()))
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(infos))
        if absent:
            raise CheckpointError(f"{root / INDEX_FILE}: listed tensors missing from their "
                                  f"shards: {absent[:5]}")
    return infos


class Shards:
    """The checkpoint's files, open while the ``with`` lasts; ``get(key)`` reads one tensor
    into a fresh buffer with a positioned read (a weight may need its scale from another
    shard), ``get_part`` one rank's slice of it. Nothing is memory-mapped: the file's
    pages stay in the page cache, not in this process, so host memory while loading
    grows by one tensor at a time. ``bytes_read`` counts the tensor bytes read."""

    def __init__(self, root: Path, infos: dict[str, TensorInfo]):
        self.root, self.infos = root, infos
        self._files: dict[str, tuple] = {}  # name -> (open file, data start, header)
        self.bytes_read = 0

    def __enter__(self) -> "Shards":
        return self

    def __exit__(self, *exc) -> None:
        for name in list(self._files):
            self.close_file(name)

    def close_file(self, name: str) -> None:
        entry = self._files.pop(name, None)
        if entry is not None:
            entry[0].close()

    def _open(self, name: str) -> tuple:
        if name not in self._files:
            path = self.root / name
            try:
                f = open(path, "rb", buffering=0)  # unbuffered: read exactly what is asked
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from None
            self._files[name] = (f, 8 + size, header)
        return self._files[name]

    def _locate(self, key: str) -> tuple:
        """(open file, file offset of the data, stored shape) of one tensor, checked."""
        info = self.infos[key]
        f, start, header = self._open(info.file)
        begin, end = header[key]["data_offsets"]
        shape = info.shape
        if info.dtype == torch.float4_e2m1fn_x2 and _numel(shape) == 2 * (end - begin):
            shape = (*shape[:-1], shape[-1] // 2)  # the header counts 4-bit values
        if _numel(shape) * info.dtype.itemsize != end - begin:
            raise CheckpointError(f"{self.root / info.file}: tensor {key!r} holds "
                                  f"{end - begin} bytes, not {list(shape)} x {info.dtype}")
        return f, start + begin, shape

    def _read_into(self, key: str, f, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            f.seek(offset + done)
            n = f.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{self.root / self.infos[key].file}: tensor {key!r} "
                                      f"is truncated")
            done += n
        self.bytes_read += done

    def get(self, key: str) -> torch.Tensor:
        f, offset, shape = self._locate(key)
        dtype = self.infos[key].dtype
        buf = torch.empty(_numel(shape) * dtype.itemsize, dtype=torch.uint8)
        self._read_into(key, f, offset, memoryview(buf.numpy()))
        return buf.view(dtype).reshape(shape)

    def get_part(self, key: str, part: tuple[int, int, int]) -> torch.Tensor:
        """Indices [start, start + length) of dim ``dim`` of one tensor (stored units),
        ``part = (dim, start, length)``, read and nothing else: a dim-0 slice is one
        contiguous read, a slice of a later dim one read per leading row."""
        dim, start, length = part
        f, offset, shape = self._locate(key)
        dtype = self.infos[key].dtype
        if not 0 <= start <= start + length <= shape[dim]:
            raise CheckpointError(f"{self.root / self.infos[key].file}: tensor {key!r} "
                                  f"{list(shape)} has no [{start}, {start + length}) on dim {dim}")
        inner = _numel(shape[dim + 1:]) * dtype.itemsize  # bytes of one index of dim
        leading = _numel(shape[:dim])  # rows that each hold one run of the slice
        run = length * inner
        buf = torch.empty(leading * run, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        for row in range(leading):
            pos = offset + row * shape[dim] * inner + start * inner
            self._read_into(key, f, pos, view[row * run:(row + 1) * run])
        return buf.view(dtype).reshape(*shape[:dim], length, *shape[dim + 1:])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
