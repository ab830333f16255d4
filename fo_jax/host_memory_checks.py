"""Host memory in programs lowered for an accelerator: what touches it besides our copy targets.

XLA's host offloader (accelerators only: a CPU compiler drops memory spaces) walks down from
every value in host memory. Parameters, get-tuple-element, bitcast, tuple, call, while,
optimization barrier, async start / done and custom calls pass; any other op on a host value
is turned into host compute ("very high overhead"). So a program whose host pools reach only
our copy targets (and pure moves) runs no host compute. That is checked here on the StableHLO
of a program lowered for an accelerator on any machine (`lower_for`): memory spaces are known
at the function's boundary (`mhlo.memory_kind`) and at explicit moves
(`annotate_device_placement`), and followed from there through loops, calls and barriers.

    module = host_memory_checks.lower_for(jitted, *args, platform="cuda", **kwargs)
    faults = host_memory_checks.host_memory_faults(module, targets=TARGETS)   # [] when clean
    host_memory_checks.assert_host_memory_only_in(module, targets=TARGETS)

tests/offload/test_ffi.py checks the offloaded programs this way; the compiled-HLO invariants
(state copies, donation, sorts, collectives) are `fo_jax.hlo_checks`'.
"""

from __future__ import annotations

from typing import Iterable

_PURE = frozenset({"stablehlo.optimization_barrier", "stablehlo.tuple"})


def lower_for(fn, *args, platform: str = "cuda", **kwargs):
    """The StableHLO module (an `ir.Module`) of the jitted `fn` lowered for `platform` on this
    machine (nothing is compiled or run)."""
    traced = fn.trace(*args, **kwargs)
    return traced.lower(lowering_platforms=(platform,)).compiler_ir("stablehlo")


def _attr(op, name: str):
    return op.attributes[name] if name in op.attributes else None


def _string(attr) -> str:
    text = str(attr)
    return text[1:-1] if text.startswith('"') and text.endswith('"') else text.lstrip("@")


def _ops(op):
    """Every operation nested in `op` (its regions' blocks), depth first."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _ops(inner)


def host_memory_faults(module, *, targets: Iterable[str]) -> list[str]:
    """What touches host memory in `module` other than pure moves and the custom calls
    `targets` (whose operand 0 is the host pool, aliased to result 0 when they return one).

    Returns one line per fault: an op that reads a host value (XLA would run it as host
    compute), a target whose operand 0 is not in host memory, a target that takes a host
    value as another operand, a target returning a pool without aliasing it, and a host value
    returned from the program in device memory. Empty: the program's host memory is touched
    only by the targets.
    """
    targets = frozenset(targets)
    funcs = {_string(op.attributes["sym_name"]): op for op in module.body.operations
             if op.operation.name == "func.func"}
    calls: dict[str, list] = {}
    for fn in funcs.values():
        for op in _ops(fn):
            if op.name in ("func.call", "call") and "callee" in op.attributes:
                calls.setdefault(_string(op.attributes["callee"]), []).append(op)
    faults: list[str] = []
    host_pools: set = set()
    seen: set = set()
    work: list = []

    def mark(value):
        if value not in seen:
            seen.add(value)
            work.append(value)

    def where(op) -> str:
        loc = str(op.location)
        return loc if len(loc) < 160 else loc[:157] + "..."

    main = funcs.get("main")
    if main is None:
        raise AssertionError("no main function in the lowered module")
    arg_attrs = _attr(main, "arg_attrs")
    for i, arg in enumerate(main.regions[0].blocks[0].arguments):
        attrs = arg_attrs[i] if arg_attrs is not None else None
        if attrs is not None and "mhlo.memory_kind" in attrs \
                and _string(attrs["mhlo.memory_kind"]) != "device":
            mark(arg)

    def check_targets(op):
        if op.name != "stablehlo.custom_call":
            return
        target = _string(op.attributes["call_target_name"])
        if target == "annotate_device_placement":
            placement = str(_attr(op, "mhlo.frontend_attributes") or "")
            if "pinned_host" in placement or "unpinned_host" in placement:
                mark(op.results[0])
        elif target in targets:
            host_pools.add(op)

    for fn in funcs.values():
        for op in _ops(fn):
            check_targets(op)

    while work:
        value = work.pop()
        for use in value.uses:
            op, k = use.owner, use.operand_number
            name = op.name
            if name == "stablehlo.custom_call":
                target = _string(op.attributes["call_target_name"])
                if target == "annotate_device_placement":
                    continue  # a move: to the device, or already marked as host
                if target in targets and k == 0:
                    if len(op.results) and "output_operand_aliases" not in op.attributes:
                        faults.append(f"{target} returns a pool it does not alias ({where(op)})")
                    elif len(op.results) and op.results[0].type == value.type:
                        mark(op.results[0])
                    continue
                faults.append(f"custom call {target} takes a host value as operand {k} "
                              f"({where(op)})")
            elif name == "stablehlo.while":
                for region in op.regions:
                    mark(region.blocks[0].arguments[k])
                mark(op.results[k])
            elif name in ("func.call", "call"):
                callee = funcs[_string(op.attributes["callee"])]
                mark(callee.regions[0].blocks[0].arguments[k])
            elif name in _PURE:
                mark(op.results[k] if len(op.results) > k else op.results[0])
            elif name == "stablehlo.return":
                parent = op.parent
                if parent.name == "stablehlo.while" and op.operation.block == \
                        parent.regions[1].blocks[0]:  # the body yields the next carry
                    mark(parent.results[k])
                else:
                    faults.append(f"{parent.name} returns a host value ({where(op)})")
            elif name in ("func.return", "return"):
                fn = op.parent
                fname = _string(fn.attributes["sym_name"])
                if fname == "main":
                    attrs = _attr(fn, "res_attrs")
                    kind = attrs[k]["mhlo.memory_kind"] if attrs is not None \
                        and "mhlo.memory_kind" in attrs[k] else None
                    if kind is None or _string(kind) == "device":
                        faults.append(f"a host value is returned in device memory (result {k})")
                for call in calls.get(fname, []):
                    mark(call.results[k])
            else:
                faults.append(f"{name} reads a host value: XLA would run it as host compute "
                              f"({where(op)})")
    for op in host_pools:
        if op.operands[0] not in seen:
            faults.append(f"{_string(op.attributes['call_target_name'])}'s pool operand is not "
                          f"in host memory ({where(op)})")
    return sorted(set(faults))


def assert_host_memory_only_in(module, *, targets: Iterable[str]) -> None:
    """Raise AssertionError listing `host_memory_faults(module, targets=targets)`, if any."""
    faults = host_memory_faults(module, targets=targets)
    if faults:
        raise AssertionError("host memory is touched outside the copy targets:\n  "
                             + "\n  ".join(faults))
