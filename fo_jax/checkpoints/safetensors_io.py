"""Read and write safetensors files with numpy: tensor by tensor, any dtype (FP8 included).

The format: an 8-byte little-endian header length n, n bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}), then the
data; offsets count from the end of the header. `SafetensorsFile` maps the file (np.memmap) and
copies out one tensor at a time, so reading a shard holds one tensor in memory, not the shard;
a file shorter than its header says (a truncated download) is refused on opening.
"""

from __future__ import annotations

import json
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


class SafetensorsFile:
    """One safetensors file opened for reading tensor by tensor.

    Attributes:
      path: the file.
      entries: {name: (dtype, shape, begin, end)} with absolute byte offsets.
      metadata: the header's "__metadata__" dict ({} if none).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
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
            header = json.loads(f.read(length))
        start = 8 + length
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries = {}
        for name, info in header.items():
            if info["dtype"] not in DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {info['dtype']!r}; "
                                 f"supported: {sorted(DTYPES)}")
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (start + int(o) for o in info["data_offsets"])
            if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ValueError(f"{self.path}: tensor {name!r} of shape {shape} "
                                 f"{info['dtype']} spans {end - begin} bytes")
            if end > size:
                raise ValueError(f"{self.path}: tensor {name!r} ends at byte {end} but the file "
                                 f"has {size} bytes (truncated file?)")
            self.entries[name] = (dtype, shape, begin, end)

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
