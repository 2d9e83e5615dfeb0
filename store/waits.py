"""Server-side waits that hold no thread (`waits/rollouts`, a long-polled dequeue).

Under the ASGI server (lightning_site/asgi.py) a request runs on a pool thread with a
`Deferral` installed. A waiting selector then checks the database once and, where it would
sleep, records a `Plan` (what to wait for, until when) instead and returns at once; the server
drops that answer, waits for the wake-up on its event loop (no thread held), and runs the
request again with the same deadline, until the selector answers without a plan (done, or the
deadline passed). Without a deferral (gunicorn, tests calling services) the selectors sleep
on their thread as before.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Plan:
    channel: str
    project_id: int
    token: int
    deadline: float  # time.monotonic()


class Deferral:
    """Installed around one run of a request; `deadline` carries the first run's deadline
    into the reruns."""

    def __init__(self, deadline: float | None = None, key: int | None = None) -> None:
        self.deadline = deadline
        self.key = key  # the request's API key (its pk), for the cap on waits per key
        self.plan: Plan | None = None


_local = threading.local()


def install(deferral: Deferral | None) -> None:
    _local.deferral = deferral


def current() -> Deferral | None:
    return getattr(_local, "deferral", None)


def note_key(key_id: int) -> None:
    """Authentication tells the deferral (if any) whose request this is."""
    deferral = current()
    if deferral is not None:
        deferral.key = key_id


def deadline_for(seconds: float) -> float:
    """A waiting selector's deadline: `seconds` from now, or the first run's under a rerun."""
    deferral = current()
    if deferral is not None and deferral.deadline is not None:
        return deferral.deadline
    return time.monotonic() + seconds


def defer(channel: str, project_id: int, token: int, deadline: float) -> bool:
    """Where a deferral is installed, record the wait for the server and answer True: the
    selector returns what it has now. Else False: the selector sleeps itself."""
    deferral = current()
    if deferral is None:
        return False
    deferral.plan = Plan(channel, project_id, token, deadline)
    return True
