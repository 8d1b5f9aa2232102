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
    cost_analysis counts a while body once, whatever its trip count."""
    program = parse(text)
    runs = executions_per_computation(program)
    total = 0.0
    for instruction in program.instructions.values():
        if instruction.opcode != "dot" or not instruction.operands:
            continue
        lhs = program.instructions.get(instruction.operands[0])
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.text)
        if lhs is None or not found:
            continue
        lhs_dims = shape_dims(lhs.shape)
        contracted = math.prod(lhs_dims[int(i)] for i in found.group(1).split(",") if i)
        out = math.prod(shape_dims(instruction.shape))
        total += 2.0 * out * contracted * runs.get(instruction.computation, 0)
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
