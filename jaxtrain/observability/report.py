"""The run report: one PNG (and an HTML page embedding it) that a person looks at first.

Curves of train and eval loss, learning rate, throughput (real and padded tokens/s) and MFU
(TFLOP/s per device where the peak is unknown) over steps, and a summary table. An online RL
run (GRPO, RLOO: it logs `reward`) gets a third row: the reward, how far the sampler's
log-probs are from the trainer's, and a mixture-of-experts policy's routing agreement (the
completion lengths for other policies). Built from
<run_dir>/metrics.jsonl and run_info.json only, so `jaxtrain report RUN_DIR` works on any
run directory, finished or not. `plot_series` returns the exact data it plots.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxtrain.errors import ArgumentError, ReportError  # noqa: F401  (ReportError: its old home)
from jaxtrain.observability.logs import read_jsonl

Series = dict[str, tuple[list[int], list[float]]]

# What an online RL run logs every round and the report draws (trainers/grpo_source.py).
LOGP_DIFFERENCE = "sampling/sampling_logp_difference/"
ROUTING_AGREEMENT = "sampling/routing_agreement/"
RL_CURVES = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    LOGP_DIFFERENCE + "mean",
    LOGP_DIFFERENCE + "max",
    ROUTING_AGREEMENT + "mean",
    ROUTING_AGREEMENT + "min",
    "completions/mean_length",
    "completions/max_length",
)


@dataclass
class Report:
    png: Path
    html: Path
    # name -> (steps, values): what each curve of the PNG shows
    series: Series
    summary: list[tuple[str, str]]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def collect_series(records: list[dict[str, Any]]) -> Series:
    """(steps, values) per metric: train metrics from logging records, eval from eval ones."""
    wanted = (
        "loss",
        "eval/loss",
        "learning_rate",
        "tokens_per_second",
        "padded_tokens_per_second",
        "examples_per_second",
        "mfu",
        "tflops_per_device",
        "grad_norm",
        "memory/device_peak_gib",
        "memory/host_rss_gib",
        *RL_CURVES,
    )
    series: Series = {}
    for record in records:
        # A mixture's per-source losses are drawn beside the loss.
        sources = [k for k in record if k.startswith("mixture/") and k.endswith("/loss")]
        for key in (*wanted, *sources):
            if key in record and _finite(record[key]):
                steps, values = series.setdefault(key, ([], []))
                steps.append(int(record["step"]))
                values.append(float(record[key]))
    return series


def task_scores(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float, float]]]:
    """Each eval task metric (one logged with a standard error: eval_tasks) over the run:
    {"python_mc acc": [(step, value, stderr), ...]}."""
    scores: dict[str, list[tuple[int, float, float]]] = {}
    for record in records:
        for key, value in record.items():
            stderr = record.get(key + "_stderr")
            if key.startswith("eval/") and _finite(value) and _finite(stderr):
                label = key[len("eval/") :].replace("/", " ", 1)
                scores.setdefault(label, []).append((int(record["step"]), float(value), stderr))
    return scores


def _fmt(value: float, digits: int = 4) -> str:
    if abs(value) >= 1e4:
        return f"{value:,.0f}"
    if 0 < abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.{digits}g}"


def summarise(records: list[dict[str, Any]], info: dict[str, Any], series: Series):
    rows: list[tuple[str, str]] = []
    if info.get("run_name"):
        rows.append(("run", str(info["run_name"])))
    if info.get("num_parameters"):
        rows.append(("parameters", f"{info['num_parameters'] / 1e6:.2f}M"))
    if info.get("device"):
        rows.append(("devices", f"{info.get('num_devices', 1)} x {info['device']}"))
    steps = [int(r["step"]) for r in records if "step" in r]
    if steps:
        rows.append(("steps", str(max(steps))))
    times = [r["time"] for r in records if _finite(r.get("time"))]
    if len(times) > 1:
        rows.append(("wall time", f"{(max(times) - min(times)) / 60:.1f} min"))
    for key, label in (("loss", "final train loss"), ("eval/loss", "final eval loss")):
        if key in series:
            rows.append((label, _fmt(series[key][1][-1])))
    evals = [r for r in records if _finite(r.get("eval/perplexity"))]
    if evals:
        rows.append(("final eval perplexity", _fmt(evals[-1]["eval/perplexity"])))
        if _finite(evals[-1].get("eval/accuracy")):
            rows.append(("final eval accuracy", f"{evals[-1]['eval/accuracy']:.3f}"))
    if "reward" in series:  # an online RL run: its last rounds and their agreement
        last = series["reward"][1][-5:]
        rows.append(("reward (last 5 rounds)", _fmt(sum(last) / len(last))))
        for key, label, worst in (
            (LOGP_DIFFERENCE + "max", "sampler log-prob diff (max)", max),
            (ROUTING_AGREEMENT + "min", "routing agreement (min)", min),
        ):
            if key in series:
                rows.append((label, _fmt(worst(series[key][1]))))
    for label, points in task_scores(records).items():  # the final score of each task
        _, value, stderr = points[-1]
        rows.append((label, f"{value:.3f} ± {stderr:.3f}"))
    # Throughput: the median of the logged windows (the first includes warm-up effects).
    for key, label in (
        ("tokens_per_second", "tokens/s (real, median)"),
        ("padded_tokens_per_second", "tokens/s (padded, median)"),
        ("examples_per_second", "examples/s (median)"),
        ("tflops_per_device", "TFLOP/s per device (median)"),
    ):
        if key in series:
            rows.append((label, _fmt(_median(series[key][1]))))
    if "mfu" in series:
        rows.append(("MFU (median)", f"{100 * _median(series['mfu'][1]):.1f}%"))
    elif info.get("device"):
        rows.append(("MFU", "n/a (peak unknown)"))
    compile_s = sum(
        v for r in records for k, v in r.items() if k.endswith("_s") and "compile/" in k
    )
    if compile_s:
        rows.append(("compile time", f"{compile_s:.1f} s"))
    if "memory/device_peak_gib" in series:
        rows.append(("peak device memory", f"{max(series['memory/device_peak_gib'][1]):.2f} GiB"))
    if "memory/host_rss_gib" in series:
        rows.append(("peak host RSS", f"{max(series['memory/host_rss_gib'][1]):.2f} GiB"))
    profile = info.get("profile")
    if isinstance(profile, dict) and profile.get("steps"):
        first, last = profile["steps"]
        rows.append((f"profile (steps {first}-{last or '?'})", str(profile.get("directory"))))
    return rows


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def plot_series(series: Series, summary: list[tuple[str, str]], path: Path) -> Series:
    """Draw the report PNG at `path`; returns {curve label: (steps, values)} as plotted."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    plotted: Series = {}
    online_rl = "reward" in series
    # Titles at a fixed height: placed above each axes' tick labels, they measured every
    # label's box at every draw (a fifth of the report's time).
    with plt.rc_context({"axes.titley": 1.01}):
        fig, axes = plt.subplots(3 if online_rl else 2, 3, figsize=(15, 12.5 if online_rl else 8.5))
    fig.suptitle("jaxtrain run report", fontsize=14, fontweight="bold")

    def draw(ax, key: str, label: str, **style: Any) -> None:
        if key in series:
            steps, values = series[key]
            ax.plot(steps, values, label=label, **style)
            plotted[key] = (list(steps), list(values))

    ax = axes[0, 0]
    draw(ax, "loss", "train", color="tab:blue")
    draw(ax, "eval/loss", "eval", color="tab:orange", marker="o")
    for key in sorted(k for k in series if k.startswith("mixture/")):
        draw(ax, key, key.split("/")[1], linestyle="--", linewidth=1)
    ax.set_title("loss (token-weighted)")
    ax = axes[0, 1]
    draw(ax, "learning_rate", "learning rate", color="tab:green")
    ax.set_title("learning rate")
    ax = axes[0, 2]
    draw(ax, "tokens_per_second", "real target tokens", color="tab:purple")
    draw(ax, "padded_tokens_per_second", "padded tokens", color="tab:gray", linestyle="--")
    draw(ax, "examples_per_second", "examples", color="tab:purple")
    ax.set_title(
        "throughput (examples/s)" if "examples_per_second" in series else "throughput (tokens/s)"
    )
    ax = axes[1, 0]
    if "mfu" in series:
        steps, values = series["mfu"]
        ax.plot(steps, [100 * v for v in values], color="tab:red", label="MFU")
        plotted["mfu"] = (list(steps), list(values))
        ax.set_title("MFU (%)")
    else:
        draw(ax, "tflops_per_device", "TFLOP/s per device", color="tab:red")
        ax.set_title("TFLOP/s per device (peak unknown: no MFU)")
    ax = axes[1, 1]
    draw(ax, "grad_norm", "grad norm", color="tab:brown")
    ax.set_title("global gradient norm")
    if online_rl:
        _draw_rl_row(axes[2], draw, series)
    for ax in [*axes.flat[:5], *axes.flat[6:]]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    ax = axes[1, 2]
    ax.axis("off")
    if summary:
        table = ax.table(
            cellText=[list(r) for r in summary],
            cellLoc="left",
            colWidths=[0.52, 0.48],
            bbox=[0.0, 0.0, 1.0, 0.97],
        )
        table.auto_set_font_size(False)
        table.set_fontsize(9)
    ax.set_title("summary")
    # Fixed margins, not tight_layout: measuring every label's box cost a third of the
    # report's time (0.4 s of every run's end); the titles and ticks fit these.
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.06, top=0.92, wspace=0.22, hspace=0.32)
    # zlib's fastest level: a third of the size's worth of time saved, the file 10-20% larger.
    fig.savefig(path, dpi=100, pil_kwargs={"compress_level": 1})
    plt.close(fig)
    return plotted


def _draw_rl_row(row: Any, draw: Any, series: Series) -> None:
    """The online RL panels: reward, sampler/trainer log-prob difference, routing agreement
    (a MoE policy) or completion lengths."""
    draw(row[0], "reward", "reward (mean)", color="tab:green")
    draw(row[0], "reward_std", "reward std", color="tab:green", linestyle="--", linewidth=1)
    draw(row[0], "frac_reward_zero_std", "groups without signal", color="tab:gray", linewidth=1)
    row[0].set_title("reward")
    draw(row[1], LOGP_DIFFERENCE + "mean", "mean", color="tab:blue")
    draw(row[1], LOGP_DIFFERENCE + "max", "max", color="tab:blue", linestyle="--")
    if any(min(series[k][1]) > 0 for k in series if k.startswith(LOGP_DIFFERENCE)):
        row[1].set_yscale("log")
    row[1].set_title("|sampler - trainer| log-prob")
    if ROUTING_AGREEMENT + "mean" in series:
        draw(row[2], ROUTING_AGREEMENT + "mean", "mean", color="tab:red")
        draw(row[2], ROUTING_AGREEMENT + "min", "least agreeing layer", color="tab:red",
             linestyle="--")  # fmt: skip
        row[2].set_title("tokens routed as the sampler did (MoE)")
    else:
        draw(row[2], "completions/mean_length", "mean", color="tab:purple")
        draw(row[2], "completions/max_length", "max", color="tab:purple", linestyle="--")
        row[2].set_title("completion length (tokens)")


def _scores_html(scores: dict[str, list[tuple[int, float, float]]]) -> str:
    """The eval tasks' scores at every evaluation: a row per step, a column per metric."""
    if not scores:
        return ""
    steps = sorted({step for points in scores.values() for step, _, _ in points})
    cells = {(label, step): (v, se) for label, pts in scores.items() for step, v, se in pts}
    head = "".join(f"<th>{html.escape(label)}</th>" for label in scores)
    body = []
    for step in steps:
        row = "".join(
            f"<td>{cells[label, step][0]:.3f} ± {cells[label, step][1]:.3f}</td>"
            if (label, step) in cells else "<td></td>"
            for label in scores
        )  # fmt: skip
        body.append(f"<tr><th>{step}</th>{row}</tr>")
    rows = "\n".join(body)
    return f"<h2>Task scores (value ± standard error)</h2><table>\n<tr><th>step</th>{head}</tr>\n{rows}\n</table>"


def _html(png: Path, summary: list[tuple[str, str]], run_dir: Path, scores: str = "") -> str:
    image = base64.b64encode(png.read_bytes()).decode("ascii")
    rows = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>jaxtrain report: {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}} th{{text-align:left;padding-right:2em}}
img{{max-width:100%}}</style></head>
<body><h1>jaxtrain run report</h1><p>{html.escape(str(run_dir))}</p>
<img alt="run report curves" src="data:image/png;base64,{image}">
<h2>Summary</h2><table>
{rows}
</table>{scores}<p>Data: metrics.jsonl in the run directory.</p></body></html>
"""


def write_report(run_dir: str | Path) -> Report:
    """Write <run_dir>/report.png and report.html from the run's metrics.jsonl."""
    run_dir = Path(run_dir)
    log = run_dir / "metrics.jsonl"
    if not log.is_file():
        raise ArgumentError(
            f"{run_dir} has no metrics.jsonl: not a jaxtrain run directory (or the run has "
            "not logged yet). Pass the output_dir of a run."
        )
    records = read_jsonl(log)
    info_path = run_dir / "run_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    series = collect_series(records)
    summary = summarise(records, info, series)
    png = run_dir / "report.png"
    plotted = plot_series(series, summary, png)
    page = run_dir / "report.html"
    page.write_text(_html(png, summary, run_dir, _scores_html(task_scores(records))))
    return Report(png=png, html=page, series=plotted, summary=summary)
