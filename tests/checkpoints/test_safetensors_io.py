"""safetensors headers: every malformed one is refused on opening, naming the file, the tensor
and the field (what came, what was expected); the tensors' bytes must tile the data section."""

import json
import struct

import numpy as np
import pytest

from fo_jax.checkpoints.safetensors_io import SafetensorsFile, write_safetensors


def _raw(path, header, data: bytes = b"") -> None:
    """A safetensors file with `header` (an object, or the header's bytes as they are)."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _f32(shape, begin):
    """The header entry of a float32 tensor of `shape` whose bytes begin at `begin`."""
    return {"dtype": "F32", "shape": list(shape),
            "data_offsets": [begin, begin + 4 * int(np.prod(shape))]}


# Two float32 tensors a [2] and b [3]: a at bytes [0, 8), b at [8, 20).
GOOD = {"a": _f32([2], 0), "b": _f32([3], 8)}

BAD_HEADERS = {
    "not JSON": (b"{not json", 0, "the header (9 bytes) is not valid JSON (Expecting"),
    "a list": ([GOOD], 20, "the header must be a JSON object {tensor name: {\"dtype\", "
                           "\"shape\", \"data_offsets\"}}, got a list"),
    "an entry a list": ({"a": ["F32", [2], [0, 8]]}, 8,
                        "tensor 'a' must be an object {\"dtype\", \"shape\", \"data_offsets\"}"
                        ", got ['F32', [2], [0, 8]]"),
    "no dtype": ({"a": {"shape": [2], "data_offsets": [0, 8]}}, 8,
                 "tensor 'a' has no \"dtype\" (a safetensors header gives each tensor \"dtype\","
                 " \"shape\" and \"data_offsets\")"),
    "no data_offsets": ({"a": {"dtype": "F32", "shape": [2]}}, 8,
                        "tensor 'a' has no \"data_offsets\""),
    "unknown dtype": ({"a": dict(_f32([2], 0), dtype="F7")}, 8,
                      "tensor 'a' has dtype 'F7'; supported: ['BF16', 'BOOL', 'F16'"),
    "dtype a list": ({"a": dict(_f32([2], 0), dtype=["F32"])}, 8,
                     "tensor 'a' has dtype ['F32']; supported"),
    "negative shape": ({"a": dict(_f32([2], 0), shape=[-2])}, 8,
                       "tensor 'a' shape=[-2] must be a list of ints >= 0"),
    "shape a string": ({"a": dict(_f32([2], 0), shape="2")}, 8,
                       "tensor 'a' shape='2' must be a list of ints >= 0"),
    "offsets reversed": ({"a": dict(_f32([2], 0), data_offsets=[8, 0])}, 8,
                         "tensor 'a' data_offsets=[8, 0] must be [begin, end], ints with 0 <= "
                         "begin <= end"),
    "offsets floats": ({"a": dict(_f32([2], 0), data_offsets=[0.0, 8.0])}, 8,
                       "tensor 'a' data_offsets=[0.0, 8.0] must be [begin, end], ints"),
    "size not the shape's": ({"a": dict(_f32([2], 0), shape=[3])}, 8,
                             "tensor 'a' of shape (3,) F32 needs 12 bytes but its data_offsets"
                             " [0, 8] span 8"),
    # The reviewer's case: every offset moved 8 bytes on, 8 stray bytes first.
    "shifted by 8 bytes": ({"a": _f32([2], 8), "b": _f32([3], 16)}, 28,
                           "bytes [0, 8) of the data section belong to no tensor (the next, "
                           "'a', begins at 8): each tensor must begin where the previous one "
                           "ends"),
    "overlap": ({"a": _f32([2], 0), "b": _f32([3], 4)}, 16,
                "tensor 'b' at data_offsets [4, 16] overlaps tensor 'a' at [0, 8]"),
    "gap": ({"a": _f32([2], 0), "b": _f32([3], 12)}, 24,
            "bytes [8, 12) of the data section belong to no tensor (the next, 'b', begins at "
            "12)"),
    "trailing bytes": (GOOD, 28, "bytes [20, 28) of the data section belong to no tensor (the "
                                 "last one, 'b', ends at 20)"),
    "metadata not strings": (dict(GOOD, __metadata__={"format": 1}), 20,
                             "__metadata__={'format': 1} must map strings to strings"),
}


@pytest.mark.parametrize("header, data_bytes, message", BAD_HEADERS.values(),
                         ids=BAD_HEADERS.keys())
def test_malformed_headers_are_refused_naming_the_tensor_and_field(tmp_path, header,
                                                                    data_bytes, message):
    path = tmp_path / "x.safetensors"
    _raw(path, header, bytes(data_bytes))
    with pytest.raises(ValueError) as err:
        SafetensorsFile(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_well_formed_file_reads_back_and_zero_size_tensors_fit_anywhere(tmp_path):
    path = tmp_path / "x.safetensors"
    tensors = {"e": np.zeros((0, 3), np.float32), "a": np.arange(2, dtype=np.float32),
               "z": np.zeros(0, np.int8), "b": np.arange(3, dtype=np.float32)}
    write_safetensors(path, tensors, {"format": "pt"})
    file = SafetensorsFile(path)
    assert file.metadata == {"format": "pt"}
    for name, value in tensors.items():
        np.testing.assert_array_equal(file.get(name), value)
    _raw(path, GOOD, np.arange(5, dtype=np.float32).tobytes())
    np.testing.assert_array_equal(SafetensorsFile(path).get("b"), [2, 3, 4])
