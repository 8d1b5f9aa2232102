"""What a run tells the people watching it: metrics, throughput and MFU, compile events,
weight statistics, trackers (jsonl, TensorBoard, W&B, MLflow), the progress line and the
run report.

The training loop talks to one object, `RunMonitor`; the other modules are its parts:

  monitor.py    RunMonitor: the per-run facade the loop calls (log, eval, compile, close)
  metrics.py    the logging window: token counts, step time, data wait
  flops.py      model FLOPs per token (the MFU numerator), formula next to the code
  hardware.py   peak FLOP/s per device kind (the MFU denominator)
  compiles.py   TrackedJit: a jit that records each compilation and its cause
  weights.py    parameter/update norms computed on device at logging cadence
  trackers.py   jsonl / TensorBoard / W&B / MLflow behind one interface
  progress.py   the terminal progress bar (rich, tqdm, json lines or none)
  logs.py       metrics.jsonl reading and writing
  report.py     write_report: report.png + report.html from a run directory
"""

from jaxtrain.errors import ReportError, TrackerError
from jaxtrain.observability.compiles import TrackedJit
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.observability.monitor import RunMonitor
from jaxtrain.observability.report import write_report

__all__ = ["ReportError", "RunMonitor", "TrackedJit", "TrackerError", "read_jsonl", "write_report"]
