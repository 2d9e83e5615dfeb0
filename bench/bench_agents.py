"""Agents the benchmarks run (workers import this module by dotted path)."""

from __future__ import annotations


def noop_agent(task):
    """Does nothing, returns nothing: what is measured is the machinery around it."""
    return None
