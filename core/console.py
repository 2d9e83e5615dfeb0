"""What commands print: the progress bar on stdout, and libraries' chatter kept out of it."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from typing import TextIO

from django.core.management.base import OutputWrapper

# Celery logs every task at INFO (172 lines for 50 embedded rollouts), httpx every request of
# the remote runner, kombu its connection details: the progress bar and summary say it better.
CHATTY_LOGGERS = ("celery", "kombu", "httpx", "httpcore")


# Each finished attempt's one-line verdict (the summary and `train_show` say it better).
VERDICT_LOGGERS = ("runners.executor",)
# Where a failed task is logged, with its traceback (a broken agent: one per rollout).
TASK_FAILURE_LOGGER = "celery.app.trace"
_IDS = re.compile(r"\b(ro|at|rs|gr)-[0-9a-f]{6,}\b|\b[0-9a-f]{8}-[0-9a-f-]{27}\b")


def quiet_libraries(verbosity: int) -> None:
    """Libraries log at WARNING in commands unless `-v 2` or more asks for their detail, and a
    task failure is printed once per kind (see RepeatedFailures)."""
    level = logging.INFO if verbosity >= 2 else logging.WARNING
    for name in CHATTY_LOGGERS + VERDICT_LOGGERS:
        logging.getLogger(name).setLevel(level)
    trace = logging.getLogger(TASK_FAILURE_LOGGER)
    for old in [f for f in trace.filters if isinstance(f, RepeatedFailures)]:
        trace.removeFilter(old)
    if verbosity < 2:
        trace.addFilter(RepeatedFailures())


class RepeatedFailures(logging.Filter):
    """A failed task is printed once per kind (its error with rollout, attempt and task ids
    taken out), as one line without the task machinery's traceback; later ones of the same kind
    are counted in `seen`, not printed. A broken agent in an embedded `train` printed 4,321
    lines; the command's summary names the count and the first traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{type(exc).__name__}: {exc}" if exc is not None else record.getMessage()
        kind = _IDS.sub("<id>", text)
        self.seen[kind] += 1
        if self.seen[kind] > 1:
            return False
        record.msg, record.args = ("%s (the first failure of its kind: later ones are counted, "
                                   "not printed; -v 2 prints each)"), (record.getMessage(),)
        record.exc_info, record.exc_text = None, None
        return True


def progress_stream(out: OutputWrapper) -> TextIO:
    """The stream under a command's stdout, for tqdm: it redraws its bar with carriage
    returns, and Django's wrapper would end each redraw with a newline."""
    return out._out


def command_hint(args: str) -> str:
    """A command line to print in a hint, as the user runs commands: `./lightning ARGS` from
    the repository's entry point (it sets LIGHTNING_COMMAND), else `manage.py ARGS`."""
    return f"`{os.environ.get('LIGHTNING_COMMAND') or 'manage.py'} {args}`"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl+C would be: a following command pauses its job the same way
    (a container stopped, a `kill`), then exits 143."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While following a job in this (main) thread, SIGTERM interrupts it as Ctrl+C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame) -> None:  # noqa: ANN001 - the signal module's signature
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
