"""The API server's command: `python -m lightning_site.web [--host H] [--port P] [--workers N]
[--threads T]`: uvicorn running the ASGI front (lightning_site/asgi.py), N processes, each with
an event loop for connections, bodies and waits, and T threads for Django's views.

No worker timeout is needed: waits are held on the event loop, not by a thread, so a long
`waits/rollouts` cannot starve or outlive a worker (gunicorn's gthread workers needed a timeout
above the longest wait). No access log: request lines would carry `?key=` and Basic user names.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def reset_metrics_dir() -> None:
    """prometheus-client's multiprocess mode (lightning_site/metrics.py): the processes share
    their counters through PROMETHEUS_MULTIPROC_DIR; start from an empty folder."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        for entry in path.iterdir():
            entry.unlink()


def default_workers() -> int:
    """$WEB_WORKERS, else one process per two of the CPUs this process may run on (at least
    one). Not one per CPU: a web process's answers are about half of a request's server CPU
    (Postgres, usually on the same host, the rest: README "Sixth pass on AGL's runner mix"),
    and on AGL's runner mix one process busy on a 2-CPU machine cost less per rollout than two
    half as busy, at the same throughput."""
    configured = os.environ.get("WEB_WORKERS")
    if configured:
        return int(configured)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: every CPU the machine has
        cpus = os.cpu_count() or 1
    return max(1, cpus // 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_site.web",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="server processes (default $WEB_WORKERS, else half the CPUs, "
                             "at least 1)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("WEB_THREADS", "8")),
                        help="threads for Django's views per process (default $WEB_THREADS, "
                             "else 8)")
    args = parser.parse_args(argv)
    os.environ["WEB_THREADS"] = str(args.threads)  # read by lightning_site.asgi in each process
    reset_metrics_dir()
    import uvicorn

    http: Any = "auto"
    if os.environ.get("WEB_ONE_WRITE", "1") == "1":
        try:
            from lightning_site.onewrite import OneWriteProtocol
        except ImportError:  # no httptools: uvicorn's own choice
            pass
        else:
            http = OneWriteProtocol
            if os.environ.get("WEB_LEAN_PROTOCOL", "1") == "1":
                # The lean routes answered in the protocol, below the ASGI cycle.
                from lightning_site import leanwire

                unsupported = leanwire.supported()
                if unsupported is None:
                    http = leanwire.LeanProtocol
                else:
                    print(f"WEB_LEAN_PROTOCOL: off, {unsupported}", file=sys.stderr)
    uvicorn.run("lightning_site.asgi:application", host=args.host.strip("[]"), port=args.port,
                workers=args.workers, log_level="warning", access_log=False,
                timeout_keep_alive=5, timeout_graceful_shutdown=10, http=http)


if __name__ == "__main__":
    main()
