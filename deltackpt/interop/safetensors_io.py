"""The safetensors file format, read and written without the ``safetensors`` package.

A file is ``u64 little-endian N`` + ``N`` bytes of JSON header + the tensors' bytes::

    {"__metadata__": {"format": "pt"},
     "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}, ...}

``data_offsets`` are ``[begin, end)`` relative to the byte after the header; the header is padded
with spaces so that the data starts at a multiple of 8 (as the reference writer does).

Writing streams: :func:`header_bytes` lays out a whole file from names, dtypes and shapes alone,
so a writer emits the header first and then each tensor's bytes as it gets them, holding one
tensor at a time. Reading treats the file as untrusted: :func:`read_header` checks the header's
size, JSON, dtypes, shapes and that every tensor's bytes lie inside the file and do not overlap,
before anything is allocated; :func:`map_tensors` then views the bytes through a private
memory map (nothing is copied until a page is read).
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from deltackpt.errors import ImportFormatError, InvalidArgumentError

# The reference implementation refuses headers over 100 MB; a real one is a few MB at most.
MAX_HEADER_BYTES = 100_000_000
ALIGN = 8
_MAX_DIM = 1 << 62

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
}
ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}


def st_dtype(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``; :class:`InvalidArgumentError` if it has none."""
    name = ST_NAMES.get(dtype)
    if name is None:
        raise InvalidArgumentError(
            f"tensor {key!r} has dtype {dtype}, which safetensors cannot store (it stores "
            f"{sorted(ST_DTYPES)}); cast it first (export_hf(dtype=...)) or leave it out "
            "(rename=... returning None)"
        )
    return name


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file: its name, safetensors dtype, shape and byte range
    ``[begin, end)`` relative to the start of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def header_bytes(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[TensorSpec]]:
    """The header (length prefix included, padded) of a file holding ``tensors`` (name,
    safetensors dtype, shape) in that order, and each tensor's byte range."""
    doc: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    specs = []
    pos = 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * ST_DTYPES[dtype].itemsize
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        specs.append(TensorSpec(name, dtype, tuple(shape), pos, pos + n))
        pos += n
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw, specs


class StreamWriter:
    """Writes one safetensors file to ``f`` tensor by tensor, in the order of its header.

    >>> w = StreamWriter(f, [("w", "F32", (2, 2))])   # doctest: +SKIP
    >>> w.write("w", torch.zeros(2, 2)); w.finish()   # doctest: +SKIP
    """

    def __init__(
        self,
        f: BinaryIO,
        tensors: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        head, self.specs = header_bytes(tensors, metadata)
        self._f = f
        self._next = 0
        f.write(head)

    def write(self, name: str, t: torch.Tensor) -> None:
        """Append tensor ``name`` (the next one the header lists) from ``t``."""
        spec = self.specs[self._next]
        if name != spec.name or ST_NAMES.get(t.dtype) != spec.dtype or tuple(t.shape) != spec.shape:
            raise AssertionError(f"writer expected {spec}, got {name!r} {t.dtype} {list(t.shape)}")
        self._next += 1
        if spec.nbytes:
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self._f.write(memoryview(data.numpy()))

    def finish(self) -> None:
        if self._next != len(self.specs):
            raise AssertionError(f"{len(self.specs) - self._next} tensors were not written")


def _bad(path: Path, what: str) -> ImportFormatError:
    return ImportFormatError(
        f"{path} is not a valid safetensors file: {what}. The file is damaged, truncated or "
        "not a safetensors file; re-download or re-export it"
    )


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(path: str | os.PathLike[str]) -> tuple[list[TensorSpec], dict[str, str], int]:
    """Validate the header of the safetensors file ``path``; return its tensors (in file
    order), its ``__metadata__`` and where the data section starts. Reads only the header."""
    p = Path(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise _bad(p, f"it is {size} bytes long, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _bad(
                p, f"its header claims {n} bytes but the file has {size - 8} after the length"
            )
        raw = f.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(p, f"its header is not UTF-8 JSON ({e})") from None
    if not isinstance(doc, dict):
        raise _bad(p, f"its header is a JSON {type(doc).__name__}, expected an object")
    data_start, data_len = 8 + n, size - 8 - n
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _bad(p, "__metadata__ must map strings to strings")
    specs = [_spec(p, name, d, data_len) for name, d in doc.items()]
    specs.sort(key=lambda s: (s.begin, s.end))
    for a, b in itertools.pairwise(specs):
        if b.begin < a.end:
            raise _bad(p, f"the bytes of {a.name!r} and {b.name!r} overlap")
    return specs, meta, data_start


def _spec(p: Path, name: str, d: Any, data_len: int) -> TensorSpec:
    if not isinstance(d, dict) or set(d) != {"dtype", "shape", "data_offsets"}:
        raise _bad(p, f"tensor {name!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offs = d["dtype"], d["shape"], d["data_offsets"]
    if dtype not in ST_DTYPES:
        raise _bad(
            p, f"tensor {name!r} has unknown dtype {dtype!r:.40} (known: {sorted(ST_DTYPES)})"
        )
    if not isinstance(shape, list) or len(shape) > 64 or not all(_int(x) for x in shape):
        raise _bad(p, f"tensor {name!r} has shape {shape!r:.80}, expected a list of ints >= 0")
    if any(x >= _MAX_DIM for x in shape):  # torch refuses such sizes even for empty tensors
        raise _bad(p, f"tensor {name!r} has shape {shape!r:.80}: a dimension of 2**62 or more")
    if not isinstance(offs, list) or len(offs) != 2 or not all(_int(x) for x in offs):
        raise _bad(p, f"tensor {name!r} has data_offsets {offs!r:.80}, expected [begin, end]")
    begin, end = offs
    if not begin <= end <= data_len:
        raise _bad(
            p,
            f"tensor {name!r} has data_offsets [{begin}, {end}] outside the {data_len} bytes "
            "of data the file holds",
        )
    want = math.prod(shape) * ST_DTYPES[dtype].itemsize  # Python ints: no overflow
    if want != end - begin:
        raise _bad(
            p,
            f"tensor {name!r} of dtype {dtype} and shape {shape} needs {want} bytes but its "
            f"data_offsets span {end - begin}",
        )
    return TensorSpec(name, dtype, tuple(shape), begin, end)


def map_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file ``path`` (validated by :func:`read_header`), in file
    order, viewing a private copy-on-write memory map of it: pages are read when touched and
    never written back."""
    specs, _, start = read_header(path)
    out: dict[str, torch.Tensor] = {}
    if not any(s.nbytes for s in specs):
        return {s.name: torch.empty(s.shape, dtype=ST_DTYPES[s.dtype]) for s in specs}
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for s in specs:
        dtype = ST_DTYPES[s.dtype]
        if s.nbytes == 0:
            out[s.name] = torch.empty(s.shape, dtype=dtype)
            continue
        u8 = torch.frombuffer(mm, dtype=torch.uint8, count=s.nbytes, offset=start + s.begin)
        if (start + s.begin) % dtype.itemsize:  # misaligned: an aligned copy can be viewed
            u8 = u8.clone()
        out[s.name] = u8.view(dtype).reshape(s.shape)
    return out
