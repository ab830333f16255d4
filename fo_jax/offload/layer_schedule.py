"""The layer schedule of the offloaded prefill: which device buffer each layer uses and when
its load is issued (the rules `fo_jax.offload.prefill` runs by; `fo_jax.offload.pipeline_model`
simulates their timing).

  * buffer 0 is pinned to layer 0 for the whole prefill: layer 0's KV is on the device before the
    loop starts;
  * buffers 1 .. n-1 rotate over layers >= 1 round-robin: layer j uses buffer
    `1 + (j - 1) % (n - 1)` (`buffer_of_layer`), so it takes over the buffer of layer
    `j - (n - 1)` (its "previous occupant"; none for j <= n - 1);
  * `onload_layer_map[i]` names the layers whose loads are issued when layer i starts computing
    (its scheduling point); every layer >= 1 is loaded exactly once, by a layer before it, into a
    buffer whose previous occupant is computed and written back by then
    (`normalize_onload_layer_map` checks a map, `default_onload_layer_map` builds "layer i loads
    layer i + d").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

OnloadLayerMap = tuple[tuple[int, ...], ...]


def check_count(name: str, value, minimum: int) -> None:
    """Raise unless `value` is an int >= `minimum` (the message names it `name`)."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_buffers(num_layers: int, num_buffers) -> None:
    minimum = min(2, num_layers)
    if not isinstance(num_buffers, (int, np.integer)) or isinstance(num_buffers, bool) or (
        num_buffers < minimum
    ):
        raise ValueError(
            f"num_buffers={num_buffers!r} must be an int >= {minimum} for num_layers={num_layers}: "
            "buffer 0 is pinned to layer 0 and layers >= 1 need at least one rotating buffer"
        )


def buffer_of_layer(layer: int, num_buffers: int) -> int:
    """The buffer layer `layer` uses: 0 for layer 0, else 1 + (layer - 1) % (num_buffers - 1)."""
    if layer == 0:
        return 0
    return 1 + (layer - 1) % (num_buffers - 1)


def default_onload_layer_map(num_layers: int, distance: int, num_buffers: int) -> OnloadLayerMap:
    """The prefetch schedule "layer i loads layer i + d", as map[i] = tuple of layers.

    Rule: the effective distance is d = max(1, min(distance, num_buffers - 2)). Layer 0 loads
    layers 1 .. d (their buffers are free at the start); layer i >= 1 loads layer i + d when it
    exists. Why the cap: layer i + d takes over the buffer of layer i + d - (n - 1); for d <= n - 2
    that layer has already computed when layer i starts, so the load waits at most for its
    write-back. For d = n - 1 it would wait for layer i itself (compute and write-back), which
    leaves no more window than d = n - 2; with n = 2 that is the only choice (d = 1, no overlap).

    Args:
      num_layers: L >= 1.
      distance: requested prefetch distance, >= 1.
      num_buffers: device buffers n, >= 2 (>= 1 when L = 1).

    Returns:
      A tuple of L tuples: entry i lists the layers whose loads start when layer i starts.
    """
    check_count("num_layers", num_layers, 1)
    check_count("distance", distance, 1)
    _check_buffers(num_layers, num_buffers)
    effective = max(1, min(distance, num_buffers - 2))
    out: list[tuple[int, ...]] = []
    for layer in range(num_layers):
        if layer == 0:
            out.append(tuple(range(1, min(effective, num_layers - 1) + 1)))
        else:
            target = layer + effective
            out.append((target,) if target < num_layers else ())
    return tuple(out)


def normalize_onload_layer_map(
    onload_layer_map: Mapping[int, int | Sequence[int]] | Sequence[int | Sequence[int] | None],
    num_layers: int,
    num_buffers: int,
) -> OnloadLayerMap:
    """Validates a prefetch schedule and returns it as a tuple of L tuples of layers.

    Accepted forms: a dict {i: j or (j, ...)} (absent i: no load), or a sequence of length L whose
    entry i is a layer j, None or -1 (no load), or a sequence of layers.

    Rules: every layer 1 .. L - 1 is loaded exactly once, layer 0 never (it is pinned); a load
    issued at layer i targets a later layer j > i (compute of j waits for it); and j - i <= n - 1,
    since layer j goes to buffer `buffer_of_layer(j, n)`, whose previous layer j - (n - 1) must be
    computed and written back by the end of layer i. A map that keeps more layers loaded ahead at
    once than the n - 1 rotating buffers hold breaks the last rule too; its message says how many
    buffers it needs.

    Raises:
      ValueError: the map breaks a rule; the message names the layers (and the buffer).
    """
    check_count("num_layers", num_layers, 1)
    _check_buffers(num_layers, num_buffers)
    if isinstance(onload_layer_map, Mapping):
        entries: dict[int, object] = {}
        for key, value in onload_layer_map.items():
            if (not isinstance(key, (int, np.integer)) or isinstance(key, bool)
                    or not 0 <= key < num_layers):
                raise ValueError(
                    f"onload_layer_map key {key!r} must be a layer in [0, {num_layers})"
                )
            entries[int(key)] = value
    elif isinstance(onload_layer_map, Sequence) and not isinstance(onload_layer_map, str):
        if len(onload_layer_map) != num_layers:
            raise ValueError(
                f"onload_layer_map has {len(onload_layer_map)} entries, expected one per layer "
                f"(num_layers={num_layers})"
            )
        entries = dict(enumerate(onload_layer_map))
    else:
        raise ValueError(
            "onload_layer_map must be a dict {layer: layer or layers} or a sequence of length "
            f"num_layers, got {type(onload_layer_map).__name__}"
        )

    loaded_by: dict[int, int] = {}
    out: list[tuple[int, ...]] = []
    for source in range(num_layers):
        value = entries.get(source)
        if value is None or (isinstance(value, (int, np.integer)) and value == -1):
            targets: tuple = ()
        elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            targets = (int(value),)
        elif isinstance(value, Sequence) and not isinstance(value, str):
            targets = tuple(value)
        else:
            raise ValueError(
                f"onload_layer_map[{source}]={value!r} must be a layer, None/-1 or a sequence "
                "of layers"
            )
        for target in targets:
            if (not isinstance(target, (int, np.integer)) or isinstance(target, bool)
                    or not 1 <= target < num_layers):
                raise ValueError(
                    f"onload_layer_map[{source}] loads {target!r}: expected a layer in "
                    f"[1, {num_layers}) (layer 0 stays in the pinned buffer 0)"
                )
            target = int(target)
            if target <= source:
                raise ValueError(
                    f"onload_layer_map[{source}] loads layer {target}: a load must be issued "
                    f"before its layer computes, so expected a layer > {source}"
                )
            if target in loaded_by:
                raise ValueError(
                    f"onload_layer_map loads layer {target} twice (at layers "
                    f"{loaded_by[target]} and {source}); expected each layer once"
                )
            loaded_by[target] = source
        out.append(tuple(int(target) for target in targets))
    _check_buffer_reuse(out, loaded_by, num_buffers)
    missing = [layer for layer in range(1, num_layers) if layer not in loaded_by]
    if missing:
        raise ValueError(
            f"onload_layer_map never loads layers {missing}; expected every layer in "
            f"[1, {num_layers}) exactly once"
        )
    return tuple(out)


def _check_buffer_reuse(schedule, loaded_by: dict[int, int], num_buffers: int) -> None:
    """Raises if a load goes to a buffer whose previous layer is not computed and written back.

    Layer j uses buffer `buffer_of_layer(j, n)`; its previous layer there is j - (n - 1). A load
    issued at layer i is fine when j - (n - 1) <= i. When it is not, the message also says whether
    the map simply keeps more layers loaded ahead than the n - 1 rotating buffers hold.
    """
    rotating = num_buffers - 1
    for source, targets in enumerate(schedule):
        for target in targets:
            previous = target - rotating
            if previous <= source:
                continue
            ahead = sorted(j for j, s in loaded_by.items() if s <= source and j > source)
            needed = 1 + len(ahead)
            extra = ""
            if needed > num_buffers:
                extra = (
                    f"; the map needs {needed} buffers at layer {source} (buffer 0 for layer 0, "
                    f"one each for layers {ahead} loaded ahead), more than num_buffers="
                    f"{num_buffers}"
                )
            raise ValueError(
                f"onload_layer_map[{source}] loads layer {target}: with num_buffers={num_buffers} "
                f"layer {target} goes to buffer {buffer_of_layer(target, num_buffers)}, whose "
                f"previous layer {previous} is not yet computed and written back when layer "
                f"{source} issues the load{extra}; expected a distance <= {rotating}"
            )
