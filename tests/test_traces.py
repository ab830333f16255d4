"""The trace format: save / load round trip and validation messages."""

import dataclasses

import numpy as np
import pytest

from fo_jax import synthetic_traces, traces


def _trace(**changes):
    trace = synthetic_traces.generate("vertical", steps=3, context=20, topk=4, groups=2, batch=2,
                                      ways=2, page_size=4, keep_all_scores=True)
    return dataclasses.replace(trace, **changes) if changes else trace


def test_round_trip(tmp_path):
    trace = _trace()
    path = tmp_path / "t.npz"
    traces.save(path, trace)
    back = traces.load(path)
    for f in dataclasses.fields(trace):
        want, got = getattr(trace, f.name), getattr(back, f.name)
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
        else:
            assert got == want, f.name
    assert (back.steps, back.groups, back.batch, back.ways, back.topk) == (3, 2, 2, 2, 4)
    assert back.capacity == 20 + 2 * 2 + 2
    assert back.head(2).selected.shape[0] == 2 and back.head(2).all_scores.shape[0] == 2


def test_validation_messages(tmp_path):
    trace = _trace()
    with pytest.raises(ValueError, match=r"trace.selected must be an int32 array \[T, G, B, W, "
                       r"K\], got int64"):
        _trace(selected=trace.selected.astype(np.int64))
    with pytest.raises(ValueError, match=r"trace.lengths must be int32 \[T, B\] = \[3, 2\]"):
        _trace(lengths=trace.lengths[:, :1])
    bad = trace.selected.copy()
    bad[0, 0, 0, 0, 0] = 999
    with pytest.raises(ValueError, match=r"trace.selected\[0, 0, 0, 0\] holds token 999, "
                       r"outside \[-1, lengths \+ way\]"):
        _trace(selected=bad)
    bad = trace.selected.copy()
    bad[0, 0, 0, 0, :2] = bad[0, 0, 0, 0, 1::-1]
    with pytest.raises(ValueError, match=r"must be in canonical order"):
        _trace(selected=bad)
    with pytest.raises(ValueError, match=r"trace.lengths must be >= 0 and never decrease"):
        _trace(lengths=trace.lengths[::-1].copy())
    with pytest.raises(ValueError, match=r"reference stats come together"):
        _trace(ref_union=np.zeros((3, 2, 2), np.int32))
    with pytest.raises(ValueError, match=r"trace.all_scores must be float \[T, G, B, W, S\]"):
        _trace(all_scores=trace.all_scores[..., :5])
    path = tmp_path / "old.npz"
    np.savez(path, version=np.int32(0), selected=trace.selected)
    with pytest.raises(ValueError, match=r"trace format version 0, expected 1"):
        traces.load(path)


def test_recorder_needs_steps():
    from fo_jax.offload.config import OffloadConfig

    with pytest.raises(ValueError, match=r"TraceRecorder.trace: no steps recorded"):
        traces.TraceRecorder(OffloadConfig(hot_slots=16)).trace()
