"""`jaxtrain plan --choices`: the run as configured against the same run with one setting
changed, each compiled on the run's mesh, so that a user sees what a setting buys before
training with it.

The settings are the ones whose effect depends on the model, the mesh and the accelerator:
  scan_layers   the decoder layers under one scan (compile time, XLA's temporaries)
  mu_dtype      AdamW's first moments in bfloat16 instead of the parameters' dtype
  fp8_matmuls   the decoder's projections with float8 operands (the roofline counts them at
                the accelerator's FP8 rate; XLA's memory figure includes the casts)
Each is flipped from the run's own value. Memory is the compiler's; time is the roofline's
(roofline.py), which sees FLOPs and bytes, not how fast a compiler runs a scanned loop: on
one H200 a scanned 1.1B step ran at 0.85x the unrolled one (bench/RESULTS.md, session 27).
"""

from __future__ import annotations

from typing import Any

from jaxtrain.parallel.dry_run import human_bytes
from jaxtrain.planning.report import mesh_name

AS_CONFIGURED = "as configured"


def choices(args: Any) -> list[tuple[str, dict[str, Any]]]:
    """(label, argument overrides) of the run as configured, then of each setting flipped."""
    from jaxtrain.config.sections import ModelSettings

    scanned = ModelSettings.from_arguments(args).scan_layers
    moments = None if args.mu_dtype else "bfloat16"
    return [
        (AS_CONFIGURED, {}),
        (f"scan_layers={str(not scanned).lower()}", {"scan_layers": not scanned}),
        (f"mu_dtype={moments}", {"mu_dtype": moments}),
        (f"fp8_matmuls={str(not args.fp8_matmuls).lower()}", {"fp8_matmuls": not args.fp8_matmuls}),
    ]


def choices_table(entries: list[dict[str, Any]]) -> list[str]:
    """Each setting's compiled memory and predicted step against the run as configured."""
    base = next(e for e in entries if e["choice"] == AS_CONFIGURED)
    lines = [
        f"  choices on {mesh_name(base['mesh'])}: each setting changed alone, against the run "
        "as configured (memory: the compiler's; time: the roofline's)",
        f"  {'setting':<24} {'per device':>11} {'change':>11} {'compute':>10} "
        f"{'step (serial)':>14} {'change':>8} {'MFU':>5}",
    ]
    for entry in entries:
        if "estimate" not in entry:
            lines.append(f"  {entry['choice']:<24} cannot run: {entry['error']}")
            continue
        est, peak = entry["estimate"], entry["figures"]["peak_bytes"]
        step = est["step_time_s"]["serial"]
        changes = ("", "")
        if "estimate" in base and entry is not base:
            base_peak = base["figures"]["peak_bytes"]
            base_step = base["estimate"]["step_time_s"]["serial"]
            sign = "+" if peak >= base_peak else "-"
            changes = (f"{sign}{human_bytes(abs(peak - base_peak))}", f"{step / base_step:.2f}x")
        lines.append(
            f"  {entry['choice']:<24} {human_bytes(peak):>11} {changes[0]:>11} "
            f"{est['compute_s'] * 1e3:>7,.2f} ms {step * 1e3:>11,.2f} ms {changes[1]:>8} "
            f"{est['mfu']['serial']:>5.0%}"
        )
    return lines
