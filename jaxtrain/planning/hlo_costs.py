"""FLOPs and memory traffic of an optimized HLO module, loops counted.

XLA's own `cost_analysis` counts a `while` body once whatever its trip count (half the FLOPs
of a step with 2 micro-batches); these read the same text as hlo.py and multiply each
computation by how many times one step runs it.
"""

from __future__ import annotations

import math
import re

from jaxtrain.planning.hlo import (
    Instruction,
    Program,
    called,
    executions_per_computation,
    parameter_index,
    parse,
    shape_bytes,
    shape_dims,
    users_of,
)


def matmul_flops(text: str) -> float:
    """FLOPs of every dot in the program per run of its entry computation, loops counted
    (2 per multiply-add: output elements times the contracted size). XLA's own
    cost_analysis counts a while body once, whatever its trip count. XLA:TPU writes its
    matmuls as convolutions (`convolution_flops`)."""
    program = parse(text)
    runs = executions_per_computation(program)
    total = 0.0
    for instruction in program.instructions.values():
        if not instruction.operands or instruction.opcode not in ("dot", "convolution"):
            continue
        lhs = program.instructions.get(instruction.operands[0])
        if lhs is None:
            continue
        if instruction.opcode == "convolution":
            flops = convolution_flops(instruction.text, shape_dims(lhs.shape), instruction.shape)
        else:
            found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.text)
            if not found:
                continue
            lhs_dims = shape_dims(lhs.shape)
            contracted = math.prod(lhs_dims[int(i)] for i in found.group(1).split(",") if i)
            flops = 2.0 * math.prod(shape_dims(instruction.shape)) * contracted
        total += flops * runs.get(instruction.computation, 0)
    return total


def convolution_flops(text: str, lhs_dims: list[int], out_shape: str) -> float:
    """2 x multiply-adds of a convolution whose input has `lhs_dims`: per output element,
    the input features of its group times the window taps that land on a real input element
    (padding and the holes of an lhs dilation contribute nothing: XLA:TPU encodes a batched
    matmul's batch dimensions as spatial ones with a dilated window)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", text)
    if labels is None:
        return 0.0
    lhs_labels, _, out_labels = labels.groups()
    out_dims = shape_dims(out_shape)
    spatial = [c for c in lhs_labels if c.isdigit()]
    window = _window(text, len(spatial))
    groups = re.search(r"feature_group_count=(\d+)", text)
    in_features = lhs_dims[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
    total = 2.0 * out_dims[out_labels.index("b")] * out_dims[out_labels.index("f")] * in_features
    for i, d in enumerate(spatial):
        total *= _taps(lhs_dims[lhs_labels.index(d)], out_dims[out_labels.index(d)], **window[i])
    return total


def _window(text: str, count: int) -> list[dict[str, int]]:
    """Per spatial dimension: size, stride, padding below, lhs and rhs dilation."""
    found = re.search(r"window=\{([^}]*)\}", text)
    fields = dict(re.findall(r"(\w+)=([\dx_]+)", found.group(1))) if found else {}

    def values(key: str, default: int) -> list[int]:
        parts = fields[key].split("x") if key in fields else []
        return [int(v) for v in parts] if parts else [default] * count

    pads = [p.split("_") for p in fields["pad"].split("x")] if "pad" in fields else []
    low = [int(p[0]) for p in pads] if pads else [0] * count
    size, stride = values("size", 1), values("stride", 1)
    lhs, rhs = values("lhs_dilate", 1), values("rhs_dilate", 1)
    return [
        {"size": size[i], "stride": stride[i], "low": low[i], "lhs": lhs[i], "rhs": rhs[i]}
        for i in range(count)
    ]


def _taps(n: int, outputs: int, *, size: int, stride: int, low: int, lhs: int, rhs: int) -> int:
    """(output position, window tap) pairs of one spatial dimension that read a real input
    element: position x * stride + tap * rhs - low of the dilated input must be a multiple of
    `lhs` inside [0, (n - 1) * lhs]."""
    last = (n - 1) * lhs
    period = lhs // math.gcd(stride, lhs)
    total = 0
    for tap in range(size):
        offset = tap * rhs - low
        first = max(0, -(offset // stride))  # ceil(-offset / stride), at least 0
        end = min(outputs - 1, (last - offset) // stride)
        if end < first:
            continue
        for r in range(period):  # outputs x = first + r + k * period share a residue
            x = first + r
            if x <= end and (x * stride + offset) % lhs == 0:
                total += (end - x) // period + 1
    return total


# Ops that move no data of their own: tuples, views, constants and control flow (the ops of
# the computations they call are counted instead).
_NO_TRAFFIC = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}


def _fused_operand_bytes(
    program: Program, users: dict[str, list[str]], callee: str, index: int, full: float
) -> float:
    """Bytes a fusion reads of its operand `index`: only the slices when every use inside is
    a dynamic slice, nothing when it is the buffer a dynamic-update-slice writes in place."""
    params = [
        p
        for p in program.computations.get(callee, [])
        if program.instructions[p].opcode == "parameter"
        and parameter_index(program.instructions[p]) == index
    ]
    if not params:
        return full
    total = 0.0
    for use in users.get(params[0], []):
        user = program.instructions[use]
        if user.opcode == "dynamic-slice":
            total += shape_bytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == params[0]:
            continue  # written in place: the update's bytes are counted as the result
        else:
            return full
    return total


def _result_bytes(program: Program, instruction: Instruction) -> float:
    """Bytes an op writes: a dynamic-update-slice (bare or a fusion's root) writes its update."""
    target = instruction
    if instruction.opcode == "fusion":
        callee = dict(called(instruction)).get("calls", "")
        names = program.computations.get(callee, [])
        root = next(
            (n for n in names if " ROOT " in f" {program.instructions[n].text.strip()}"), None
        )
        target = program.instructions[root] if root else instruction
    if target.opcode == "dynamic-update-slice" and len(target.operands) > 1:
        update = program.instructions.get(target.operands[1])
        if update is not None:
            return shape_bytes(update.shape)
    return shape_bytes(instruction.shape)


def memory_traffic(text: str) -> float:
    """Bytes the program reads and writes in memory per run, loops counted: for every op of
    the control-flow computations (entry, loop bodies, calls; not the insides of fusions) the
    bytes it reads of its operands and writes of its result. A slice reads only the slice and
    an in-place update writes only the update, which matters inside loops (a blockwise
    attention's scan). XLA's cost_analysis counts a while body once."""
    program = parse(text)
    users = users_of(program)
    runs = executions_per_computation(program)
    control = {program.entry}
    for instruction in program.instructions.values():
        if instruction.opcode in ("while", "call", "conditional"):
            control.update(callee for role, callee in called(instruction) if role != "condition")
    total = 0.0
    for computation in control:
        times = runs.get(computation, 0)
        for name in program.computations.get(computation, []):
            instruction = program.instructions[name]
            if instruction.opcode in _NO_TRAFFIC:
                continue
            callee = dict(called(instruction)).get("calls", "")
            read = 0.0
            for index, operand in enumerate(instruction.operands):
                if operand not in program.instructions:
                    continue
                full = shape_bytes(program.instructions[operand].shape)
                if instruction.opcode == "fusion":
                    read += _fused_operand_bytes(program, users, callee, index, full)
                elif instruction.opcode == "dynamic-update-slice" and index == 0:
                    continue
                elif instruction.opcode == "dynamic-slice" and index == 0:
                    read += shape_bytes(instruction.shape)
                else:
                    read += full
            total += (read + _result_bytes(program, instruction)) * times
    return total
