"""Performance invariants of compiled steps, read from the optimized HLO and its memory analysis.

A step may be bit-for-bit right and still cost O(C) or O(S) per step because XLA copied a whole
state array; these checks read the optimized HLO and fail, naming the instruction, so that the
regression fails a test on any machine (a CPU is enough: copy insertion and buffer aliasing are
decided before any backend code is emitted). Why, and which bugs they caught:
docs/design/performance-invariants.md.

Pools and page tables (fo_jax.offload.state: host KV [L, F, Z, D+R], indexer keys
[G, F, Z, N], the page table [B, P] int32) are ordinary state leaves here: a step that copies
or rewrites a whole pool, or the table, fails like any other (tests/offload/test_decode_hlo.py
checks a pool of F != B P pages under a permuted table, so the pools' shapes are distinctive).

Use it for a new compiled step like this (small, distinctive shapes so that no intermediate
array happens to share a state array's shape and dtype):

    from fo_jax import hlo_checks

    # The program the public entry point runs (its validation, its donation), compiled only:
    compiled = hlo_checks.compile_call(fo_jax.offload.decode, "decode_jit", decode_step,
                                       params, state, tokens, config=config, offload=offload,
                                       compiler_options=hlo_checks.FAST_COMPILE)
    # or a jitted function directly (static arguments as keywords):
    #   compiled = hlo_checks.compile_jitted(my_step_jit, params, state, tokens, config=config)
    hlo_checks.assert_no_state_copies(compiled, state, ignore=("lengths", "step"))
    hlo_checks.assert_donation_aliased(compiled, state, ignore=("lengths", "step"))
    hlo_checks.assert_no_sort_over(compiled, offload.hot_slots)   # no sort / top-k over C
    temps = hlo_checks.temp_bytes(compiled)   # compare two compilations, at two C or two S

`params` may be `jax.ShapeDtypeStruct`s (`jax.eval_shape(init_params, ...)`): nothing runs.
Every check takes the `jax.stages.Compiled` or its optimized HLO text; tests/offload/
test_decode_hlo.py is the worked example (decode step for every policy, prefill).

Collectives of a sharded step: `collectives(compiled)` lists them (opcode, arrays, line) and
`assert_collectives(compiled, {"all-to-all": 3})` asserts exactly those counts (every other
collective: none); tests/sharding/all_to_all_cases.py checks the expert-parallel MoE this way.

Host memory in programs lowered for an accelerator (what XLA's host offloader would run as host
compute) is `fo_jax.host_memory_checks`'s.

State leaves are named by their pytree path ("slots.slot_to_token", "policy.hand"); `ignore`
names leaves whose copies are allowed (per-request counters such as lengths: O(B), not O(C)
or O(S)); `created` names arrays the program makes itself (add them to the checked pytree as
`jax.ShapeDtypeStruct`s, e.g. the prefill's layer buffers): one initialization each is
allowed. Leaves of rank 0 or size 0 are never checked.

What counts as a violation (an AssertionError naming the HLO instruction), for an instruction
outside fusion bodies whose array result has the shape and dtype of a checked state leaf:

  * `copy`, `copy-start` / `copy-done` (including the copies of a while-loop tuple);
  * a fusion whose root is not an in-place update (`dynamic-update-slice` or `scatter`,
    possibly under bitcasts): it writes a fresh full-shape buffer (e.g. a full-shape select);
  * any other op that makes a new full-shape array (select, broadcast, add, ...), and a
    custom call without `output_to_operand_aliasing`. An elementwise op over a whole state
    array is O(size) work even where XLA reuses the donated buffer, so it is reported too.

Pass-through ops (parameter, get-tuple-element, tuple, bitcast, opt-barrier, while,
conditional, call) and bare in-place `dynamic-update-slice` / `scatter` are allowed: XLA runs
them in place unless copy insertion adds a copy, and that copy is then caught.

Limits: shapes are compared, not buffers, so two leaves of one shape are checked together and
an unrelated temporary of a state leaf's shape and dtype is reported too (choose shapes that
avoid it, or `ignore` the leaf). The checks read HLO text, whose format is stable in practice
but not an API; a parse that finds no instructions fails loudly rather than passing.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable

import jax
import numpy as np

# Ops that produce no new buffer, or update their operand in place unless a copy is added.
_PASS_THROUGH = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
                           "while", "conditional", "call", "constant"})
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
_COPIES = frozenset({"copy", "copy-start", "copy-done"})
_TOP_K_TARGET = re.compile(r'custom_call_target="(topk|top_k|approxtopk)', re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class StateLeaf:
    """One state array as the HLO shows it: name (pytree path), HLO dtype, dims."""

    name: str
    dtype: str
    dims: tuple[int, ...]

    @property
    def shape_text(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its computation, name, opcode, result type text and full line."""

    computation: str
    name: str
    opcode: str
    type_text: str
    line: str


def hlo_dtype(dtype) -> str:
    """The HLO spelling of a numpy / jax dtype: int32 -> s32, bfloat16 -> bf16, bool -> pred."""
    name = np.dtype(dtype).name
    if name == "bool":
        return "pred"
    match = re.fullmatch(r"(u?int|float|bfloat|complex)(\d+)(.*)", name)
    if not match:
        return name
    kind, bits, rest = match.groups()
    prefix = {"int": "s", "uint": "u", "float": "f", "bfloat": "bf", "complex": "c"}[kind]
    return f"{prefix}{bits}{rest}"


def _path_name(path) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(key))
    return ".".join(parts)


def state_leaves(state: Any, ignore: Iterable[str] = ()) -> list[StateLeaf]:
    """Every leaf of `state` with rank >= 1 and size >= 1, minus the names in `ignore`.

    Raises ValueError when `ignore` names a leaf the state does not have (a typo would
    silently check less).
    """
    ignore = set(ignore)
    leaves, names = [], set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = _path_name(path)
        names.add(name)
        shape = tuple(np.shape(leaf))
        if name in ignore or len(shape) == 0 or int(np.prod(shape)) == 0:
            continue
        leaves.append(StateLeaf(name, hlo_dtype(leaf.dtype), shape))
    unknown = ignore - names
    if unknown:
        raise ValueError(f"ignore names {sorted(unknown)}, which are not leaves of the state; "
                         f"its leaves are {sorted(names)}")
    return leaves


# XLA options for checks: no LLVM optimization of the generated CPU code. The optimized HLO and
# its buffer assignment (all these checks read) are unchanged; compilation is ~40% faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def compile_jitted(fn, *args, compiler_options: dict | None = None,
                   **kwargs) -> jax.stages.Compiled:
    """Lower and compile the jitted `fn` for these arguments (nothing runs, nothing is donated).

    `compiler_options` go to `Lowered.compile` (e.g. `FAST_COMPILE` in tests).
    """
    if not hasattr(fn, "lower"):
        raise TypeError(f"{fn!r} is not a jitted function: wrap it in jax.jit first")
    lowered = fn.lower(*args, **kwargs)
    return lowered.compile(compiler_options=compiler_options) if compiler_options \
        else lowered.compile()


class _Captured(Exception):
    pass


def captured_call(module, name: str, entry, *args, **kwargs):
    """(jitted, args, kwargs): the call `entry(*args, **kwargs)` makes to `module.<name>`.

    `entry` is a public function that validates its inputs and then calls the jitted
    `module.<name>`. The jitted function is swapped for a recorder while `entry` runs, so
    nothing is computed or donated.
    """
    jitted = getattr(module, name)
    calls = []

    def record(*a, **k):
        calls.append((a, k))
        raise _Captured

    setattr(module, name, record)
    try:
        entry(*args, **kwargs)
    except _Captured:
        pass
    finally:
        setattr(module, name, jitted)
    if not calls:
        raise AssertionError(f"{getattr(entry, '__name__', entry)} returned without calling "
                             f"{module.__name__}.{name}")
    return jitted, calls[0][0], calls[0][1]


def compile_call(module, name: str, entry, *args, compiler_options: dict | None = None,
                 **kwargs) -> jax.stages.Compiled:
    """Compile what `entry(*args, **kwargs)` would run: the call it makes to `module.<name>`.

    `entry` is a public function that validates its inputs and then calls the jitted
    `module.<name>` (e.g. `compile_call(fo_jax.offload.prefill, "prefill_jit",
    fo_jax.offload.prefill.prefill, params, state, tokens, config=config)`). The recorded call
    (`captured_call`) is compiled: the program a user runs, with its donation, not an outer
    `jax.jit` around `entry` (which would drop the donation and change the program).
    """
    jitted, a, k = captured_call(module, name, entry, *args, **kwargs)
    return compile_jitted(jitted, *a, compiler_options=compiler_options, **k)


def optimized_hlo(compiled) -> str:
    """The optimized HLO text of a `jax.stages.Compiled` (or the text itself)."""
    return compiled if isinstance(compiled, str) else compiled.as_text()


def temp_bytes(compiled) -> int:
    """Bytes of temporaries the compiled program allocates (`memory_analysis()`).

    Compare it across two compilations that differ only in C (or S) to show that a step's
    temporaries do not grow with that size.
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise NotImplementedError("this backend gives no memory analysis of compiled programs")
    return int(analysis.temp_size_in_bytes)


# Parsing ------------------------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


def _split_type(rest: str) -> tuple[str, str]:
    """Split 'TYPE opcode(...)...' into (TYPE, 'opcode(...)...'); TYPE may be a tuple."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail.lstrip()


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], dict[str, str], str | None]:
    """Parse HLO text: ({computation: instructions}, {computation: root name}, entry name)."""
    computations: dict[str, list[Instruction]] = {}
    roots: dict[str, str] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match and not line.startswith("HloModule"):
                current = match.group(2)
                computations[current] = []
                if match.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        type_text, rest = _split_type(match.group(3))
        opcode = re.match(r"([\w\-]+)", rest)
        if not opcode:
            continue
        inst = Instruction(current, match.group(2), opcode.group(1), type_text, line.strip())
        computations[current].append(inst)
        if match.group(1):
            roots[current] = inst.name
    if not computations or entry is None:
        raise AssertionError("found no HLO computations in the text: the HLO text format may "
                             "have changed; fo_jax.hlo_checks needs an update")
    return computations, roots, entry


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The array types in a (possibly tuple) HLO type, in order: [(dtype, dims)]."""
    return [(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
            for m in _ARRAY.finditer(type_text)]


def _called(line: str, attribute: str) -> list[str]:
    match = re.search(attribute + r"=\{?([^}]*?)\}?(,|$)", line)
    if not match:
        return []
    return [name.strip().lstrip("%") for name in match.group(1).split(",") if name.strip()]


def _fused_and_applied(computations) -> tuple[set[str], set[str]]:
    """Fusion bodies (`calls=` of fusions) and applied regions (reducers, comparators)."""
    fused, applied = set(), set()
    for insts in computations.values():
        for inst in insts:
            if inst.opcode == "fusion":
                fused.update(_called(inst.line, "calls"))
            elif inst.opcode != "call":
                applied.update(_called(inst.line, "to_apply"))
                if inst.opcode == "custom-call":
                    applied.update(_called(inst.line, "called_computations"))
    return fused, applied


def _first_operand(inst: Instruction) -> str | None:
    match = re.search(re.escape(inst.opcode) + r"\(%?([\w.\-]+)", inst.line)
    return match.group(1) if match else None


def _root_opcodes(computations, roots, name: str) -> list[str]:
    """Opcodes that produce each output of a fused computation (through bitcasts).

    An in-place update (dynamic-update-slice, scatter) counts as one only when the array it
    updates is a parameter of the fusion; one into an array made inside the fusion (e.g.
    `jnp.zeros(...).at[i].set(x)`) writes every element and is reported as "fresh <opcode>".
    """
    by_name = {inst.name: inst for inst in computations.get(name, [])}

    def through_bitcasts(inst):
        while inst is not None and inst.opcode == "bitcast":
            operand = _first_operand(inst)
            inst = by_name.get(operand) if operand else None
        return inst

    def producer(inst_name: str) -> str:
        inst = through_bitcasts(by_name.get(inst_name))
        if inst is None:
            return "?"
        if inst.opcode in _IN_PLACE:
            target = through_bitcasts(by_name.get(_first_operand(inst) or ""))
            if target is None or target.opcode != "parameter":
                return f"fresh {inst.opcode}"
        return inst.opcode

    root = by_name.get(roots.get(name, ""))
    if root is None:
        return []
    if root.opcode == "tuple":
        operands = re.search(r"tuple\((.*?)\)", root.line)
        names = [o.strip().lstrip("%") for o in operands.group(1).split(",")] if operands else []
        return [producer(n) for n in names]
    return [producer(root.name)]


# Checks -------------------------------------------------------------------------------------

def state_array_writes(compiled, state, *, ignore: Iterable[str] = (),
                       created: Iterable[str] = ()) -> list[str]:
    """Descriptions of every instruction that writes a whole state array into a new buffer.

    See the module docstring for what counts; an empty list means none. `created` names
    leaves the program makes itself rather than receives (the prefill's layer buffers): one
    fresh write of each (its initialization) is allowed, copies never.
    """
    leaves = state_leaves(state, ignore)
    created = set(created)
    unknown = created - {leaf.name for leaf in leaves}
    if unknown:
        raise ValueError(f"created names {sorted(unknown)}, which are not checked leaves of the "
                         f"state; they are {sorted(leaf.name for leaf in leaves)}")
    initialized: set[str] = set()
    by_shape: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for leaf in leaves:
        by_shape.setdefault((leaf.dtype, leaf.dims), []).append(leaf.name)
    computations, roots, _ = parse_hlo(optimized_hlo(compiled))
    fused, applied = _fused_and_applied(computations)
    found = []
    for comp, insts in computations.items():
        if comp in fused or comp in applied:
            continue
        for inst in insts:
            arrays = _arrays(inst.type_text)
            if inst.type_text.startswith("("):
                outputs = list(enumerate(arrays))
            else:
                outputs = [(0, arrays[0])] if arrays else []
            hits = [(i, by_shape[a]) for i, a in outputs if a in by_shape]
            if not hits or inst.opcode in _PASS_THROUGH or inst.opcode in _IN_PLACE:
                continue
            if inst.opcode == "fusion":
                producers = [p for c in _called(inst.line, "calls")
                             for p in _root_opcodes(computations, roots, c)]
                hits = [(i, names) for i, names in hits
                        if i >= len(producers) or producers[i] not in _IN_PLACE]
                if not hits:
                    continue
            if inst.opcode == "custom-call" and "output_to_operand_aliasing" in inst.line:
                continue
            if inst.opcode.startswith("async-"):
                continue
            names = sorted({n for _, ns in hits for n in ns})
            if (inst.opcode not in _COPIES and set(names) <= created
                    and not set(names) & initialized):
                initialized.update(names)
                continue
            found.append(f"{inst.opcode} of state {'/'.join(names)} in computation {comp}: "
                         f"{inst.line[:300]}")
    return found


def assert_no_state_copies(compiled, state, *, ignore: Iterable[str] = (),
                           created: Iterable[str] = ()) -> None:
    """Fail (AssertionError naming the instructions) if the program copies a whole state array.

    Args:
      compiled: a `jax.stages.Compiled` (see `compile_jitted`) or optimized HLO text.
      state: the state pytree the step takes (arrays or ShapeDtypeStructs); every leaf's
        shape and dtype is looked for.
      ignore: leaf names (pytree paths, e.g. "lengths") whose copies are allowed.
      created: leaf names of arrays the program creates (e.g. layer buffers, passed as
        `jax.ShapeDtypeStruct`s inside `state`): their one initialization is allowed.
    """
    found = state_array_writes(compiled, state, ignore=ignore, created=created)
    if found:
        raise AssertionError(f"{len(found)} whole-state-array writes into fresh buffers (O(size) "
                             "per step, not in place):\n  " + "\n  ".join(found))


_ALIAS = re.compile(r"\{([\d,\s]*)\}:\s*\((\d+),\s*\{([\d,\s]*)\}")


def input_output_aliases(compiled) -> list[tuple[tuple[int, ...], int, tuple[int, ...]]]:
    """The module's `input_output_alias` entries: [(output index, parameter, parameter index)]."""
    text = optimized_hlo(compiled)
    header = text.split("\n", 1)[0]
    start = header.find("input_output_alias={")
    if start < 0:
        return []
    depth, end = 0, start + len("input_output_alias=")
    for end in range(end, len(header)):
        depth += header[end] == "{"
        depth -= header[end] == "}"
        if depth == 0:
            break
    body = header[start + len("input_output_alias="):end + 1]
    ints = lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    return [(ints(m.group(1)), int(m.group(2)), ints(m.group(3))) for m in _ALIAS.finditer(body)]


def entry_parameters(compiled) -> dict[int, tuple[str, tuple[int, ...], str]]:
    """{parameter number: (HLO dtype, dims, instruction line)} of the entry computation."""
    computations, _, entry = parse_hlo(optimized_hlo(compiled))
    params = {}
    for inst in computations[entry]:
        if inst.opcode == "parameter":
            number = int(re.search(r"parameter\((\d+)\)", inst.line).group(1))
            arrays = _arrays(inst.type_text)
            if arrays:
                params[number] = (arrays[0][0], arrays[0][1], inst.line)
    return params


def assert_donation_aliased(compiled, state, *, ignore: Iterable[str] = ()) -> None:
    """Fail unless `input_output_alias` lets every (donated) state leaf be updated in place.

    Counted per shape and dtype: for every state leaf there must be one aliased parameter of
    its shape and dtype (leaves that share a shape need as many aliased parameters). A leaf
    with no alias gets a fresh output buffer each step: a whole copy, or twice the memory.
    """
    leaves = state_leaves(state, ignore)
    params = entry_parameters(compiled)
    aliased: dict[tuple[str, tuple[int, ...]], int] = {}
    for _, number, _ in input_output_aliases(compiled):
        if number in params:
            dtype, dims, _ = params[number]
            aliased[(dtype, dims)] = aliased.get((dtype, dims), 0) + 1
    need: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for leaf in leaves:
        need.setdefault((leaf.dtype, leaf.dims), []).append(leaf.name)
    missing = [f"{'/'.join(names)} ({dtype}[{','.join(map(str, dims))}]): "
               f"{len(names)} needed, {aliased.get((dtype, dims), 0)} aliased"
               for (dtype, dims), names in need.items()
               if aliased.get((dtype, dims), 0) < len(names)]
    if missing:
        raise AssertionError("donated state leaves without an input_output_alias (each step "
                             "allocates and fills a new buffer):\n  " + "\n  ".join(missing))


def sorts_over(compiled, size: int) -> list[str]:
    """Every sort or top-k whose sorted axis has `size` elements, as instruction lines."""
    computations, _, _ = parse_hlo(optimized_hlo(compiled))
    found = []
    for insts in computations.values():
        shapes = {inst.name: _arrays(inst.type_text) for inst in insts}
        for inst in insts:
            axis_sizes = []
            if inst.opcode == "sort":
                dims = re.search(r"dimensions=\{(\d+)\}", inst.line)
                arrays = _arrays(inst.type_text)
                if dims and arrays:
                    axis_sizes.append(arrays[0][1][int(dims.group(1))])
            elif inst.opcode == "topk" or (inst.opcode == "custom-call"
                                           and _TOP_K_TARGET.search(inst.line)):
                operand = re.search(inst.opcode + r"\(%?([\w.\-]+)", inst.line)
                arrays = shapes.get(operand.group(1), []) if operand else []
                if arrays and arrays[0][1]:
                    axis_sizes.append(arrays[0][1][-1])  # top-k runs over the last axis
            if size in axis_sizes:
                found.append(inst.line[:300])
    return found


def assert_no_sort_over(compiled, size: int, *, what: str = "C") -> None:
    """Fail if any sort or top-k of the program runs over an axis of `size` elements.

    For the ring policy: no sort or top-k over the C hot slots (choose C distinct from every
    other sorted size: W K, S, ...).
    """
    found = sorts_over(compiled, size)
    if found:
        raise AssertionError(f"{len(found)} sorts / top-ks over {what} = {size} elements "
                             f"(O({what} log {what}) per step):\n  " + "\n  ".join(found))


# Collectives -----------------------------------------------------------------------------------

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast", "reduce-scatter")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its opcode (an async pair's, without -start), the
    arrays of its result type [(HLO dtype, dims)] (XLA:CPU's all-to-all: one array per peer;
    an async start's type may hold its operands too) and the HLO line."""

    opcode: str
    arrays: tuple
    line: str


def collectives(compiled) -> list[Collective]:
    """Every collective instruction of the optimized HLO, in text order, wherever it is (a
    while loop's body holds a loop's collectives once, whatever its trip count). An async pair
    counts once (by its -start; the -done is skipped). Nothing of a collective is inferred
    from names: the opcode is HLO's."""
    found = []
    computations, _, _ = parse_hlo(optimized_hlo(compiled))
    for insts in computations.values():
        for inst in insts:
            base = inst.opcode.removesuffix("-start")
            if base in COLLECTIVES and not inst.opcode.endswith("-done"):
                found.append(Collective(base, tuple(_arrays(inst.type_text)), inst.line))
    return found


def assert_collectives(compiled, expected: dict[str, int], *, what: str = "the program"):
    """The compiled program holds exactly `expected[opcode]` collectives of each opcode (absent:
    none), counted by `collectives`; an AssertionError names what differs, with the lines."""
    got = collectives(compiled)
    counts = {}
    for c in got:
        counts[c.opcode] = counts.get(c.opcode, 0) + 1
    wrong = {op: (counts.get(op, 0), expected.get(op, 0)) for op in set(counts) | set(expected)
             if counts.get(op, 0) != expected.get(op, 0)}
    if wrong:
        lines = "\n".join(c.line[:200] for c in got)
        raise AssertionError(
            f"{what} holds collectives {dict(sorted(counts.items()))}, expected "
            f"{dict(sorted(expected.items()))} (got, expected per opcode: {wrong}):\n{lines}")
    return got
