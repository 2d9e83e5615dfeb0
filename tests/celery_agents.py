"""Small agents the Celery and executor tests run (found by dotted path, as users' agents are)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from opentelemetry import trace

from runners.tracing import emit_message, emit_reward


def ok_agent(task, rollout):
    """Emits an instrumented-library span and a message; the reward is the input's `i`."""
    with trace.get_tracer("some.instrumented.lib").start_as_current_span("llm.call") as span:
        span.set_attribute("gen_ai.prompt", f"question {task['i']}")
    emit_message(f"done {rollout.rollout_id}")
    return float(task["i"])


def emitting_agent(task):
    """Emits two rewards, the second the input's `x` (read as a float: "nan", "inf")."""
    emit_reward({"primary": 1.0, "other": float(task["x"])})


def noop_agent(task):
    return None


def failing_agent(task):
    raise ValueError(f"bad input {task!r}")


def threaded_agent(task):
    """A span started in a thread of its own, with no context propagated."""
    def work() -> None:
        with trace.get_tracer("lib").start_as_current_span("in.thread"):
            pass

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return 1.0


def llm_agent(task, llm, resources):
    """AGL style: a resource by its name."""
    return 1.0 if llm["endpoint"] == resources["llm"]["endpoint"] == task["endpoint"] else 0.0


def looping_agent(task, rollout):
    """Runs until stopped (cancellation), at most `seconds`."""
    deadline = time.monotonic() + task.get("seconds", 60)
    while time.monotonic() < deadline:
        time.sleep(0.01)
    return 0.0


def fails_once_cancelled_agent(task, rollout):
    """Its rollout is cancelled while it runs (here by itself, through the store, as a trainer
    re-planning a group does), and its next call fails because of it, before the runner's
    watcher has seen the cancellation: as an LLM call the model gateway refuses (409) does."""
    from store import services
    from store.models import Rollout

    project = Rollout.objects.get(pk=rollout.rollout_id).project
    services.rollout_update(project=project, rollout_id=rollout.rollout_id, status="cancelled")
    raise RuntimeError("409 Conflict: the rollout was cancelled; its calls are no longer recorded")


def die_once_agent(task):
    """First run: records its pid in `task["marker"]` and blocks (the test kills it). Later runs:
    succeed."""
    marker = Path(task["marker"])
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        time.sleep(task.get("seconds", 60))
        return 0.0
    return 1.0


class CountingAgent:
    """The class form."""

    def rollout(self, task, rollout_id):
        return 2.0 if rollout_id.startswith("ro-") else 0.0


def burning_agent(task):
    """Burns `cpu_seconds` of this thread's CPU time (the cost ledger's reconciliation)."""
    until = time.thread_time() + task.get("cpu_seconds", 0.2)
    n = 0
    while time.thread_time() < until:
        n += 1
    return 1.0
