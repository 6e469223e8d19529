"""Metrics of a run: sinks (JSONL, TensorBoard, W&B), the live console view, end-of-run plots
and summary. Key conventions the loop follows are in `asyncrl.metrics.keys`."""

from asyncrl.metrics.history import History, MetricsError
from asyncrl.metrics.logger import MetricsLogger, clean_metrics, report_from_jsonl
from asyncrl.metrics.sinks import JsonlSink, Sink, TensorBoardSink, WandbSink
from asyncrl.metrics.summary import summarize

__all__ = [
    "History",
    "JsonlSink",
    "MetricsError",
    "MetricsLogger",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "clean_metrics",
    "report_from_jsonl",
    "summarize",
]
