"""Agents the benchmarks run (workers import this module by dotted path)."""

from __future__ import annotations

import time


def noop_agent(task):
    """Does nothing, returns nothing: what is measured is the machinery around it."""
    return None


def sleep_agent(task):
    """Holds its slot for task["seconds"]: a worker-second is a worker-second."""


    time.sleep(task["seconds"])
