"""The collectives of an optimized HLO module, read from its text (hlo_costs.py: its FLOPs
and memory traffic).

`collectives(hlo_text)` lists every all-gather, reduce-scatter, all-reduce, all-to-all and
collective-permute with the bytes it moves, the size of its device groups, which devices those
groups hold and how many times one step runs it (a collective inside a `while` body runs once
per iteration: XLA writes the loop's `known_trip_count`).

One rewrite reads the CPU's program as an accelerator's: XLA's CPU pipeline keeps the SPMD
partitioner's "all-reduce, then keep my slice" where the GPU and TPU pipelines emit a
reduce-scatter (the gradient of an fsdp-sharded parameter). An all-reduce element whose every
use only takes a 1/n slice (n: the group size) is counted as the reduce-scatter it becomes there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_CALLED = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Ops a gradient passes through unchanged on its way to the slice that keeps one shard.
_TRANSPARENT = ("get-tuple-element", "bitcast", "copy", "reshape", "convert", "transpose")
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "negate", "select", "maximum", "minimum"}


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    text: str
    computation: str


@dataclass
class Collective:
    """One collective op of the program, as one step runs it."""

    kind: str
    # Bytes of the full (unsharded along the group) tensor: all-gather's result, the
    # reduce-scatter's and all-reduce's input, all-to-all's and collective-permute's operand.
    bytes: float
    group_size: int
    groups: list[list[int]]  # partition ids per group ([] when the op names none)
    executions: int  # per step (loop trip counts multiplied in)
    name: str = ""
    note: str = ""

    @property
    def link_bytes(self) -> float:
        """Bytes each device sends per execution with a ring or pairwise algorithm."""
        n = self.group_size
        if self.kind == "collective-permute":
            return self.bytes
        if n <= 1:
            return 0.0
        share = (n - 1) / n * self.bytes
        return 2 * share if self.kind == "all-reduce" else share

    def spans_nodes(self, node_of: list[int]) -> bool:
        return any(len({node_of[p] for p in group}) > 1 for group in self.groups)


@dataclass
class Program:
    instructions: dict[str, Instruction] = field(default_factory=dict)
    computations: dict[str, list[str]] = field(default_factory=dict)
    entry: str = ""
    fused_by: dict[str, str] = field(default_factory=dict)  # fused computation -> its fusion


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (a tuple counts all its elements)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape.split(" ", 1)[0] if "(" not in shape else shape):
        if dtype not in _DTYPE_BYTES:
            continue
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * _DTYPE_BYTES[dtype]
    return total


def shape_dims(shape: str) -> list[int]:
    """The dimensions of an HLO array shape (the first array of a tuple)."""
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def shape_elements(shape: str) -> int:
    """Elements of an HLO shape (a tuple counts all its elements)."""
    return sum(
        math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        for dtype, dims in _ARRAY.findall(shape)
        if dtype in _DTYPE_BYTES
    )


def _split_shape(rest: str) -> tuple[str, str]:
    """('shape', 'opcode(...)...') of an instruction's right-hand side."""
    if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].strip()
    shape, _, tail = rest.partition(" ")
    return shape, tail.strip()


def _operands(call: str) -> list[str]:
    start = call.find("(")
    if start < 0:
        return []
    depth, end = 0, len(call)
    for i in range(start, len(call)):
        depth += call[i] == "("
        depth -= call[i] == ")"
        if depth == 0:
            end = i
            break
    inside = call[start + 1 : end]
    named = re.findall(r"%([\w.\-]+)", inside)
    if named or not inside.strip():
        return named
    # Names without "%" (the text of a module before optimization): the last word of each
    # operand, split at the commas outside brackets.
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(inside):
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == "," and depth == 0:
            parts.append(inside[last:i])
            last = i + 1
    parts.append(inside[last:])
    return [part.split()[-1] for part in parts if part.split()]


def parse(text: str) -> Program:
    program = Program()
    current = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("(", 1)[0]:
            current = header.group(2)
            program.computations[current] = []
            if header.group(1):
                program.entry = current
            continue
        match = _INSTRUCTION.match(line)
        if not match or not current:
            continue
        name, rest = match.groups()
        shape, call = _split_shape(rest)
        opcode = call.split("(", 1)[0].strip()
        program.instructions[name] = Instruction(
            name, shape, opcode, _operands(call), line, current
        )
        program.computations[current].append(name)
    for instruction in program.instructions.values():
        if instruction.opcode == "fusion":
            for role, callee in called(instruction):
                if role == "calls":
                    program.fused_by[callee] = instruction.name
    return program


def called(instruction: Instruction) -> list[tuple[str, str]]:
    pairs = _CALLED.findall(instruction.text)
    branches = _BRANCHES.search(instruction.text)
    if branches:
        pairs += [("branch", b.strip().lstrip("%")) for b in branches.group(1).split(",")]
    return pairs


def executions_per_computation(program: Program) -> dict[str, int]:
    """How many times one run of the entry computation runs each computation."""
    counts = {program.entry: 1}
    order = [program.entry]
    while order:
        computation = order.pop()
        for name in program.computations.get(computation, []):
            instruction = program.instructions[name]
            trips = 1
            if instruction.opcode == "while":
                found = _TRIP_COUNT.search(instruction.text)
                trips = int(found.group(1)) if found else _counted_trips(program, instruction)
            for role, callee in called(instruction):
                times = counts[computation] * (trips if role in ("body", "condition") else 1)
                if counts.get(callee, 0) < times:
                    counts[callee] = times
                    order.append(callee)
    return counts


def _counted_trips(program: Program, loop: Instruction) -> int:
    """Trips of a while loop without XLA's known_trip_count (XLA:TPU writes none): its
    condition compares a counter of the loop's tuple with a constant (`i < n`), and the
    counter starts from the tuple's constant (0 where that is not visible). 1 when the
    condition is anything else."""
    condition = dict(called(loop)).get("condition", "")
    names = program.computations.get(condition, [])
    root = next((n for n in names if " ROOT " in f" {program.instructions[n].text.strip()}"), None)
    if root is None:
        return 1
    compare = program.instructions[root]
    direction = re.search(r"direction=(LT|LE|GT|GE)", compare.text)
    if compare.opcode != "compare" or direction is None or len(compare.operands) != 2:
        return 1
    counter, bound = (program.instructions.get(o) for o in compare.operands)
    if counter is None or bound is None or direction.group(1) not in ("LT", "LE"):
        return 1
    limit = _constant(bound)
    index = re.search(r"index=(\d+)", counter.text)
    if counter.opcode != "get-tuple-element" or limit is None or index is None:
        return 1
    start = 0
    init = program.instructions.get(loop.operands[0]) if loop.operands else None
    if init is not None and init.opcode == "tuple" and int(index.group(1)) < len(init.operands):
        first = program.instructions.get(init.operands[int(index.group(1))])
        start = (_constant(first) if first is not None else None) or 0
    return max(1, limit - start + (1 if direction.group(1) == "LE" else 0))


def _constant(instruction: Instruction) -> int | None:
    found = re.search(r"constant\((-?\d+)\)", instruction.text)
    return int(found.group(1)) if instruction.opcode == "constant" and found else None


def _parse_groups(text: str, devices: int) -> list[list[int]]:
    """The partition-id groups of a collective, in any of XLA's three spellings."""
    found = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]*)\](?:T\(([\d,]*)\))?)? \{([^}]*)\}", text
    )
    if found:
        axes = re.findall(r"'([^']*)'=(\d+)", found.group(1))
        names = [a for a, _ in axes]
        sizes = [int(s) for _, s in axes]
        ids = _iota(sizes, found.group(2), found.group(3))
        grouped = [names.index(a) for a in re.findall(r"'([^']*)'", found.group(4))]
        return _groups_along(ids, grouped)
    found = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if found:
        shape = [int(s) for s in found.group(1).split(",")]
        ids = _iota(shape, found.group(2), found.group(3)).reshape(shape)
        return ids.reshape(-1, shape[-1]).tolist()
    found = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)?\}", text)
    if found and found.group(1):
        return [
            [int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", found.group(1))
        ]
    return [list(range(devices))]  # no groups named: all devices form one


def _iota(sizes: list[int], reshape: str | None, transpose: str | None) -> np.ndarray:
    if reshape is None:
        return np.arange(math.prod(sizes)).reshape(sizes)
    dims = [int(s) for s in reshape.split(",") if s]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if transpose:
        ids = ids.transpose([int(s) for s in transpose.split(",")])
    return ids.reshape(sizes)


def _groups_along(ids: np.ndarray, axes: list[int]) -> list[list[int]]:
    rest = [a for a in range(ids.ndim) if a not in axes]
    moved = ids.transpose(rest + axes)
    size = math.prod(ids.shape[a] for a in axes) if axes else 1
    return moved.reshape(-1, size).tolist()


def _pairs(text: str) -> list[list[int]]:
    found = re.search(r"source_target_pairs=\{(.*?)\}\}", text)
    if not found:
        return []
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", found.group(0))]


def users_of(program: Program) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for instruction in program.instructions.values():
        for operand in instruction.operands:
            users.setdefault(operand, []).append(instruction.name)
    return users


def _only_sliced(
    program: Program, users: dict[str, list[str]], name: str, keep: int, depth: int = 0
) -> bool:
    """Is only a slice of at most `keep` elements of `name`'s value ever used? Followed
    through elementwise ops, tuple elements and the insides of fusions (a fusion's result
    carries the value on when its root does)."""
    instruction = program.instructions[name]
    uses = users.get(name, [])
    if depth > 12:
        return False
    if not uses:  # a fused computation's root: the fusion's own uses decide
        caller = program.fused_by.get(instruction.computation)
        if caller is None:
            return False
        fusion = program.instructions[caller]
        if shape_elements(fusion.shape) <= keep:
            return True
        return _only_sliced(program, users, caller, keep, depth + 1)
    for use in uses:
        user = program.instructions[use]
        if user.opcode == "dynamic-slice":
            if shape_elements(user.shape) > keep:
                return False
        elif user.opcode in _TRANSPARENT or user.opcode in _ELEMENTWISE:
            if not _only_sliced(program, users, use, keep, depth + 1):
                return False
        elif user.opcode == "tuple":
            if not _only_sliced_in_branches(program, users, user, name, keep, depth):
                return False
        elif user.opcode == "fusion":
            callee = dict(called(user)).get("calls")
            positions = [i for i, o in enumerate(user.operands) if o == name]
            params = [
                p
                for p in program.computations.get(callee or "", [])
                if program.instructions[p].opcode == "parameter"
                and parameter_index(program.instructions[p]) in positions
            ]
            if not params or not all(
                _only_sliced(program, users, p, keep, depth + 1) for p in params
            ):
                return False
        else:
            return False
    return True


def _only_sliced_in_branches(
    program: Program,
    users: dict[str, list[str]],
    packed: Instruction,
    name: str,
    keep: int,
    depth: int,
) -> bool:
    """`name` packed into a tuple that is a conditional's operand (the Trainer's non-finite
    guard): is only a slice of it used inside each branch that receives the tuple?"""
    indices = {i for i, o in enumerate(packed.operands) if o == name}
    for use in users.get(packed.name, []):
        conditional = program.instructions[use]
        if conditional.opcode != "conditional":
            return False
        branches = [callee for role, callee in called(conditional) if role != "to_apply"]
        for position, operand in enumerate(conditional.operands[1:]):
            if operand != packed.name or position >= len(branches):
                continue
            for param in program.computations.get(branches[position], []):
                if program.instructions[param].opcode != "parameter":
                    continue
                for gte in users.get(param, []):
                    element = program.instructions[gte]
                    found = re.search(r"index=(\d+)", element.text)
                    if element.opcode != "get-tuple-element" or not found:
                        return False
                    if int(found.group(1)) in indices and not _only_sliced(
                        program, users, gte, keep, depth + 1
                    ):
                        return False
    return True


def parameter_index(instruction: Instruction) -> int:
    found = re.search(r"parameter\((\d+)\)", instruction.text)
    return int(found.group(1)) if found else -1


def _elements(
    program: Program, instruction: Instruction, users: dict[str, list[str]]
) -> list[tuple[str, float]]:
    """(name whose uses hold the value, bytes) per element of a (possibly tuple) result."""
    if not instruction.shape.startswith("("):
        return [(instruction.name, shape_bytes(instruction.shape))]
    elements = []
    for use in users.get(instruction.name, []):
        gte = program.instructions[use]
        if gte.opcode == "get-tuple-element":
            elements.append((gte.name, shape_bytes(gte.shape)))
    return elements


def collectives(text: str, devices: int) -> list[Collective]:
    """Every collective of the optimized HLO `text` of a program over `devices` partitions."""
    program = parse(text)
    runs = executions_per_computation(program)
    users = users_of(program)
    found: list[Collective] = []
    for instruction in program.instructions.values():
        kind = instruction.opcode.removesuffix("-start")
        if kind not in KINDS:
            continue
        executions = runs.get(instruction.computation, 0)
        if executions == 0:
            continue
        if kind == "collective-permute":
            # What each device sends: its operand. (XLA:TPU's asynchronous start returns a
            # tuple of the operand, the result and two counters: its shape counts it twice.)
            sent = sum(
                shape_bytes(program.instructions[o].shape)
                for o in instruction.operands
                if o in program.instructions
            )
            pairs = _pairs(instruction.text)
            found.append(
                Collective(
                    kind,
                    sent or shape_bytes(instruction.shape),
                    2,
                    pairs,
                    executions,
                    instruction.name,
                )
            )
            continue
        groups = _parse_groups(instruction.text, devices)
        n = max(len(groups[0]), 1) if groups else devices
        if kind != "all-reduce":
            if kind == "all-gather":
                size = shape_bytes(instruction.shape)
                if instruction.opcode.endswith("-start") and instruction.shape.startswith("("):
                    # An asynchronous start's tuple holds the operands, then the results.
                    size -= sum(
                        shape_bytes(program.instructions[o].shape)
                        for o in instruction.operands
                        if o in program.instructions
                    )
            else:  # reduce-scatter, all-to-all: the operands' bytes
                size = sum(
                    shape_bytes(program.instructions[o].shape)
                    for o in instruction.operands
                    if o in program.instructions
                )
            found.append(Collective(kind, size, n, groups, executions, instruction.name))
            continue
        reduced = scattered = 0.0
        for element, size in _elements(program, instruction, users):
            elements = shape_elements(program.instructions[element].shape)
            if n > 1 and _only_sliced(program, users, element, elements // n):
                scattered += size
            else:
                reduced += size
        if reduced:
            found.append(Collective("all-reduce", reduced, n, groups, executions, instruction.name))
        if scattered:
            found.append(
                Collective(
                    "reduce-scatter",
                    scattered,
                    n,
                    groups,
                    executions,
                    instruction.name,
                    note="all-reduce + slice on CPU",
                )
            )
    return found
