"""Read and write safetensors files with numpy: tensor by tensor, any dtype (FP8 included).

The format: an 8-byte little-endian header length n, n bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}), then the
data; offsets count from the end of the header. `SafetensorsFile` reads the header on opening
and then one tensor at a time (its bytes only), so reading a shard holds one tensor in memory,
not the shard.

Refused on opening, with one line naming the file, the tensor and the field: a file shorter than
its header says (a truncated download), a header that is not a JSON object of entries with a
known "dtype", a "shape" of ints >= 0 and "data_offsets" [begin, end] spanning exactly
prod(shape) * itemsize bytes, and offsets that do not tile the data section (sorted, each
tensor beginning where the previous one ends, the last ending at the end of the file: an
overlap, a gap or stray bytes would load wrong weights silently).
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _show(value) -> str:
    """repr(value), cut to 80 characters (messages stay one short line)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class SafetensorsFile:
    """One safetensors file opened for reading tensor by tensor.

    Attributes:
      path: the file.
      entries: {name: (dtype, shape, begin, end)} with absolute byte offsets.
      metadata: the header's "__metadata__" dict ({} if none).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"{self.path}: {size} bytes, too short for a safetensors "
                                     "header (truncated file?)")
                (length,) = struct.unpack("<Q", head)
                if 8 + length > size:
                    raise ValueError(f"{self.path}: header of {length} bytes but the file has "
                                     f"{size} bytes (truncated file?)")
                blob = f.read(length)
        except OSError as err:
            raise ValueError(f"{self.path} cannot be read ({err.strerror or err})") from None
        try:
            header = json.loads(blob)
        except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{self.path}: the header ({length} bytes) is not valid JSON "
                             f"({err})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: the header must be a JSON object {{tensor name: "
                             f'{{"dtype", "shape", "data_offsets"}}}}, got a '
                             f"{type(header).__name__}")
        metadata = header.pop("__metadata__", None) or {}
        if not (isinstance(metadata, dict)
                and all(isinstance(v, str) for v in metadata.values())):
            raise ValueError(f"{self.path}: __metadata__={_show(metadata)} must map strings to "
                             "strings")
        self.metadata = metadata
        start = 8 + length
        self.entries, spans = {}, []
        for name, info in header.items():
            dtype, shape, begin, end = self._entry(name, info)
            if start + end > size:
                raise ValueError(f"{self.path}: tensor {name!r} ends at byte {start + end} but "
                                 f"the file has {size} bytes (truncated file?)")
            self.entries[name] = (dtype, shape, start + begin, start + end)
            spans.append((begin, end, name))
        self._check_tiling(spans, size - start)

    def _entry(self, name: str, info) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, begin, end) of one header entry, offsets relative to the data."""
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ValueError(f'{where} must be an object {{"dtype", "shape", "data_offsets"}}, '
                             f"got {_show(info)}")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                raise ValueError(f'{where} has no "{key}" (a safetensors header gives each '
                                 'tensor "dtype", "shape" and "data_offsets")')
        name_, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(name_, str) or name_ not in DTYPES:
            raise ValueError(f"{where} has dtype {_show(name_)}; supported: {sorted(DTYPES)}")
        if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
            raise ValueError(f"{where} shape={_show(shape)} must be a list of ints >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_count(n) for n in offsets) and offsets[0] <= offsets[1]):
            raise ValueError(f"{where} data_offsets={_show(offsets)} must be [begin, end], ints "
                             "with 0 <= begin <= end (bytes of the data section)")
        dtype, (begin, end) = DTYPES[name_], offsets
        need = math.prod(shape) * dtype.itemsize
        if end - begin != need:
            raise ValueError(f"{where} of shape {tuple(shape)} {name_} needs {need} bytes but "
                             f"its data_offsets [{begin}, {end}] span {end - begin}")
        return dtype, tuple(shape), begin, end

    def _check_tiling(self, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
        """The tensors' bytes (spans: (begin, end, name), relative to the data section), in
        order, must tile the data section: no byte read by two tensors (overlap) or by none (a
        gap, stray bytes first or last). A header whose offsets moved would load the wrong
        bytes into every tensor, silently; the safetensors format forbids it (its own reader
        refuses such files too)."""
        at, last = 0, None
        for begin, end, name in sorted(spans):
            if begin < at:
                raise ValueError(
                    f"{self.path}: tensor {name!r} at data_offsets [{begin}, {end}] overlaps "
                    f"tensor {last[2]!r} at [{last[0]}, {last[1]}]: each tensor must begin "
                    "where the previous one ends")
            if begin > at:
                raise ValueError(
                    f"{self.path}: bytes [{at}, {begin}) of the data section belong to no "
                    f"tensor (the next, {name!r}, begins at {begin}): each tensor must begin "
                    "where the previous one ends")
            at, last = end, (begin, end, name)
        if at != data_bytes:
            raise ValueError(
                f"{self.path}: bytes [{at}, {data_bytes}) of the data section belong to no "
                "tensor (" + (f"the last one, {last[2]!r}, ends at {at}" if last
                              else "the header names none") + ")")

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> np.ndarray:
        """A copy of tensor `name` (reads its bytes only)."""
        dtype, shape, begin, end = self.entries[name]
        out = np.empty(shape, dtype)
        if begin == end:
            return out
        with open(self.path, "rb") as f:  # straight into `out`: one copy of the tensor
            f.seek(begin)
            got = f.readinto(out.reshape(-1).view(np.uint8))
        if got != end - begin:
            raise ValueError(f"{self.path}: tensor {name!r} is cut short (truncated file?)")
        return out


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (C-contiguous copies are made as needed) to `path`."""
    header, offset = {}, 0
    for name, value in tensors.items():
        dtype = np.dtype(value.dtype)
        if dtype not in _NAMES:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {dtype}; supported: "
                             f"{sorted(str(d) for d in _NAMES)}")
        size = value.size * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for value in tensors.values():
            f.write(np.ascontiguousarray(value).tobytes())
