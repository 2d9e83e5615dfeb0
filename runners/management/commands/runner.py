"""`manage.py runner`: a remote runner for machines with no database access (README
"Runner API")."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from core import agl_roles
from core.console import quiet_libraries
from runners.client import ApiError, StoreClient
from runners.remote_runner import RemoteRunner, RunnerOptions, default_server

log = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Claim rollouts from a store server over HTTP and run them with an agent."
    # A remote runner has no database or broker: the checks of those settings are not its own.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--server", default=default_server(),
                            help="http://host:port (default: AGL_SERVER_HOST/AGL_SERVER_PORT)")
        parser.add_argument("--key", default=None,
                            help="a runner API key (default: $LIGHTNING_API_KEY)")
        parser.add_argument("--agent", required=True,
                            help="dotted path of the agent, e.g. examples.hello:agent")
        parser.add_argument("--concurrency", type=int, default=1, help="rollouts run at once (1)")
        parser.add_argument("--worker-id", default="",
                            help="the name the store knows this runner by (default: made up)")
        parser.add_argument("--wait-seconds", type=float, default=5.0,
                            help="long-poll of an idle dequeue (server caps it at 20)")
        parser.add_argument("--heartbeat-seconds", type=float, default=5.0,
                            help="heartbeat interval of a running attempt")
        parser.add_argument("--span-batch-size", type=int, default=100,
                            help="spans shipped per request")
        parser.add_argument("--max-rollouts", type=int, default=None,
                            help="stop after this many rollouts (default: run until SIGTERM)")

    def handle(self, *args: Any, **opts: Any) -> None:
        quiet_libraries(opts["verbosity"])
        if not agl_roles.runs_rollouts(agl_roles.current_role()):
            raise CommandError("AGL_CURRENT_ROLE=algorithm: this process runs no rollouts")
        key = opts["key"] or _env_key()
        if not opts["server"]:
            raise CommandError("--server is required (or set AGL_SERVER_HOST)")
        if not key:
            raise CommandError("--key is required (or set LIGHTNING_API_KEY)")
        if opts["concurrency"] < 1:
            raise CommandError("--concurrency must be >= 1")
        options = RunnerOptions(
            agent=opts["agent"], concurrency=opts["concurrency"], worker_id=opts["worker_id"],
            wait_seconds=opts["wait_seconds"], heartbeat_seconds=opts["heartbeat_seconds"],
            span_batch_size=opts["span_batch_size"], max_rollouts=opts["max_rollouts"],
        )
        with StoreClient(opts["server"], key) as client:
            runner = RemoteRunner(client, options)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: runner.stop())
            self.stdout.write(f"runner {runner.worker_id}: serving {opts['server']} "
                              f"with {options.concurrency} slots", ending="\n")
            self.stdout.flush()
            try:
                runner.run()
            except ApiError as exc:
                raise CommandError(str(exc)) from exc
        self.stdout.write(f"runner {runner.worker_id}: stopped after {runner.claimed} rollouts")


def _env_key() -> str | None:
    return os.environ.get("LIGHTNING_API_KEY")
