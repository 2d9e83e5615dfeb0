"""`./lightning serve`: the one-command store (AGL's `agl store`): migrate, a default project
and key on first start, then the API server (lightning_site/web.py: uvicorn, the ASGI front)."""

from __future__ import annotations

import os
import sys

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from store import services
from store.models import ApiKey

DEFAULT_PORT = 4747  # Agent Lightning's own default (AGL_SERVER_PORT)


def _port_from_env() -> int:
    raw = os.environ.get("AGL_SERVER_PORT")
    if raw is None:
        return DEFAULT_PORT
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise CommandError(f"AGL_SERVER_PORT={raw!r} is not a port number")
    return int(raw)


class Command(BaseCommand):
    help = ("Serve the store's API (Agent Lightning 0.3 protocol) with one command: migrate, "
            "create the project and an algorithm key on first start (the key is printed "
            "once), then run the API server. Example: ./lightning serve --port 4747")

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1",
                            help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
        parser.add_argument("--port", type=int, default=None,
                            help=f"port (default: $AGL_SERVER_PORT, else {DEFAULT_PORT})")
        parser.add_argument("--project", default="default",
                            help="project made on first start (default: default)")
        parser.add_argument("--workers", type=int, default=2,
                            help="server processes, 8 threads each (default 2)")

    def handle(self, *args, host, port, project, workers, **options):
        port = port or _port_from_env()
        call_command("migrate", verbosity=0, interactive=False)
        raw = services.project_first_start(name=project, role=ApiKey.Role.ALGORITHM)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        where = "SQLite " + settings.DATABASES["default"]["NAME"] if settings.EMBEDDED \
            else "Postgres (DATABASE_URL)"
        if raw:
            self.stdout.write(f"Created project {project!r} and an algorithm key (shown once, "
                              "keep it). Connect an AGL client with:")
            self.stdout.write(f'  LightningStoreClient("http://algorithm:{raw}@{shown}:{port}")')
        else:
            self.stdout.write(f"Project {project!r} exists; a new key: ./lightning "
                              f"apikey_create {project} --role algorithm")
        self.stdout.write(f"Store API at http://{shown}:{port}/v1/agl (docs: /api/docs/), "
                          f"on {where}; Ctrl-C stops it.")
        self.stdout.flush()
        self._exec_server(host, port, workers)

    def _exec_server(self, host: str, port: int, workers: int) -> None:
        env = dict(os.environ)
        # Several processes share /metrics counters through a folder of their own (emptied at
        # start by lightning_site/web.py).
        env.setdefault("PROMETHEUS_MULTIPROC_DIR", str(settings.DATA_DIR / f"metrics-{port}"))
        argv = [sys.executable, "-m", "lightning_site.web", "--host", host, "--port", str(port),
                "--workers", str(workers), "--threads", "8"]
        os.execve(sys.executable, argv, env)
