"""The plan as text (a table of meshes, the chosen one in detail) and as plan.json."""

from __future__ import annotations

from typing import Any

from jaxtrain.parallel.dry_run import human_bytes
from jaxtrain.planning.hlo import KINDS

AXES = ("dp", "fsdp", "ep", "tp", "sp")


def mesh_name(dims: list[int]) -> str:
    named = [f"{a}={n}" for a, n in zip(AXES, dims, strict=True) if n != 1]
    return " ".join(named) or "one device"


def ranked(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Meshes that fit first, fastest (nothing overlapped) first; then those that do not fit,
    by how much they miss; then those that cannot run."""

    def key(entry: dict[str, Any]) -> tuple[int, float]:
        if "estimate" not in entry:
            return (2, 0.0)
        est = entry["estimate"]
        if est["fits"]:
            return (0, est["step_time_s"]["serial"])
        return (1, -est["headroom_bytes"])

    return sorted(entries, key=key)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def figure_of(entries: list[dict[str, Any]]) -> str:
    """The compiler whose memory figure the verdicts and the ranking use."""
    compiler = next((e["compiler"]["compiler"] for e in entries if e.get("compiler")), None)
    return compiler or "XLA:CPU"


def table(entries: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"  ranked: meshes that fit first, by step time; 'fits' and 'per device' are "
        f"{figure_of(entries)}'s figures",
        f"  {'mesh':<24} {'fits':<5} {'per device':>11} {'by shapes':>11} {'step (serial)':>14} "
        f"{'(overlapped)':>13} {'MFU':>11} bound",
    ]
    for entry in entries:
        name = mesh_name(entry["mesh"])
        if "estimate" not in entry:
            lines.append(f"  {name:<24} cannot run: {entry['error']}")
            continue
        est, fig = entry["estimate"], entry["figures"]
        mfu = est["mfu"]
        lines.append(
            f"  {name:<24} {'yes' if est['fits'] else 'NO':<5} "
            f"{human_bytes(fig['peak_bytes']):>11} {human_bytes(fig['shape_estimate_bytes']):>11} "
            f"{_ms(est['step_time_s']['serial']):>14} "
            f"{_ms(est['step_time_s']['overlapped']):>13} "
            f"{mfu['serial']:>5.0%}-{mfu['overlapped']:<4.0%} {est['bound']}"
        )
    return lines


def engine_lines(sampler: dict[str, Any]) -> list[str]:
    """The engine an online RL run samples on: its pool, its largest step, where it runs, and
    the parameter copies of asynchronous rounds."""
    memory, own = sampler["memory"], sampler.get("devices")
    where = f"on {own} rollout device(s) of its own" if own else "on these devices"
    lines = [
        f"    GRPO engine       {human_bytes(memory['pool_bytes']):>12}  page pool {where}, held "
        f"through the run; its largest step peaks at {human_bytes(memory['peak'])} per device "
        f"({sum(sampler['shapes'].values())} shapes)"
    ]
    if sampler.get("async_copies_bytes"):
        lines.append(
            f"    async copies      {human_bytes(sampler['async_copies_bytes']):>12}  "
            f"parameters of the rounds in flight (max_staleness), {where}"
        )
    return lines


def details(entry: dict[str, Any], accel_name: str) -> list[str]:
    fig, est = entry["figures"], entry["estimate"]
    mem, state = fig["memory"], fig["state"]
    fit = "fits" if est["fits"] else "DOES NOT FIT"
    margin = abs(est["headroom_bytes"])
    lines = [
        f"{mesh_name(entry['mesh'])}: {fit} on {accel_name} "
        f"({human_bytes(fig['peak_bytes'])} of {human_bytes(est['hbm_bytes'])} per device, "
        f"{'free' if est['fits'] else 'short'} {human_bytes(margin)})",
        "  per device (from the compiled step):",
        f"    parameters        {human_bytes(state['parameters']):>12}",
        f"    optimizer state   {human_bytes(state['optimizer_state']):>12}",
        f"    gradients         {human_bytes(state['gradients']):>12}  (inside the temporaries)",
        *(
            [
                f"    frozen weights    {human_bytes(state['frozen']):>12}  (reference, teacher, base)"
            ]
            if state.get("frozen")
            else []
        ),
        f"    XLA temporaries   {human_bytes(mem['temporaries']):>12}  (gradients, activations, "
        "workspace)",
        f"    inputs + outputs  {human_bytes(mem['arguments'] + mem['outputs'] - mem['aliased']):>12}"
        "  (state donated: outputs written over inputs)",
        f"    peak              {human_bytes(fig['peak_bytes']):>12}  "
        f"({figure_of([entry])}'s buffer assignment)",
        *(engine_lines(fig["sampler"]) if "sampler" in fig else []),
        f"    by shapes         {human_bytes(fig['shape_estimate_bytes']):>12}  (state, gradients, "
        f"activations, two layers gathered: {'fits' if est['fits_by_shapes'] else 'does not fit'})",
        f"  FLOPs per step: model {fig['model_flops']:.3e} (causal, as the Trainer logs them); "
        f"compiled matmuls {fig['matmul_flops'] * fig['devices']:.3e} "
        f"({fig['matmul_flops'] * fig['devices'] / fig['model_flops']:.2f}x: full attention "
        "scores, recompute)",
        "  collectives per step (per device: bytes of the tensors, bytes sent on the links):",
    ]
    for kind in KINDS:
        c = fig["collectives"][kind]
        if c["count"]:
            lines.append(
                f"    {kind:<19} {c['count']:>7,.0f} ops {human_bytes(c['bytes']):>12} "
                f"{human_bytes(c['link_bytes']):>12}"
            )
    comm = est["communication_s"]
    lines += [
        f"  time per step: compute {_ms(est['compute_s'])}, memory {_ms(est['memory_s'])}, "
        f"communication {_ms(comm['intra_node'])} in nodes + {_ms(comm['inter_node'])} "
        "between nodes",
        f"  compiled: {fig['method']} in {sum(fig['compile_seconds']):.1f} s",
    ]
    return lines
