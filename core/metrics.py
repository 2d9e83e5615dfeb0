"""Prometheus pieces every process shares: latency buckets, and this process's metrics as text
(all of gunicorn's workers in prometheus-client's multiprocess mode). The web's `/metrics`
(lightning_site/metrics.py) adds the store's state; the model gateway serves these alone."""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess

# Long waits (waits/rollouts, long-polled dequeues) last up to a minute: buckets reach past it.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 90)


def process_registry() -> CollectorRegistry:
    # prometheus-client switches to multiprocess mode when the variable is set at all.
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def process_metrics() -> bytes:
    """This process's metrics (all of gunicorn's workers in multiprocess mode), as text."""
    return generate_latest(process_registry())
