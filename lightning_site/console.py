"""What commands print: the progress bar on stdout, and libraries' chatter kept out of it."""

from __future__ import annotations

import logging
from typing import TextIO

from django.core.management.base import OutputWrapper

# Celery logs every task at INFO (172 lines for 50 embedded rollouts), httpx every request of
# the remote runner, kombu its connection details: the progress bar and summary say it better.
CHATTY_LOGGERS = ("celery", "kombu", "httpx", "httpcore")


def quiet_libraries(verbosity: int) -> None:
    """Libraries log at WARNING in commands unless `-v 2` or more asks for their detail."""
    level = logging.INFO if verbosity >= 2 else logging.WARNING
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def progress_stream(out: OutputWrapper) -> TextIO:
    """The stream under a command's stdout, for tqdm: it redraws its bar with carriage
    returns, and Django's wrapper would end each redraw with a newline."""
    return out._out
