"""gunicorn settings for the API server (`gunicorn -c python:lightning_site.gunicorn_conf`).

Threads, because `waits/rollouts` and a long-polled dequeue hold their request for up to a
minute: with sync workers four such requests block every other one, health checks included.
The timeout must exceed the longest server-side wait (store.api.limits.MAX_WAIT_SECONDS, 60 s),
or gunicorn kills the worker mid-wait and the client gets a 500. Command-line flags override
these values (docker-compose.yml and the README pass them explicitly, to be read at a glance).
"""

from __future__ import annotations

import os

from prometheus_client import multiprocess

from lightning_site.web import default_workers

bind = f"0.0.0.0:{os.environ.get('PORT', '8000')}"
worker_class = "gthread"
workers = default_workers()  # as python -m lightning_site.web
threads = int(os.environ.get("WEB_THREADS", "8"))
timeout = 90
# Access lines for every API request would drown the workers' logs; errors still go to stderr.
accesslog = None
# When an access log is turned on (--access-logfile), it never shows a key: the Basic auth
# user is `-`, `?key=`-like parameters read REDACTED (lightning_site/gunicorn_logging.py).
logger_class = "lightning_site.gunicorn_logging.RedactingLogger"


# prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, lightning_site/metrics.py):
# every worker writes its counters to files there; start from an empty folder, and fold a dead
# worker's live gauges away.
def on_starting(server) -> None:
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))


def child_exit(server, worker) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(worker.pid)
