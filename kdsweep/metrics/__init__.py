"""Metric sinks behind one logger, and the run record."""

from kdsweep.metrics.sinks import JsonlSink, MetricLogger

__all__ = ["JsonlSink", "MetricLogger"]
