"""`manage.py llm_serve`: the model gateway in its own process (README "Training LLM agents")."""

from __future__ import annotations

import errno
import socket

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from trainer.llm.server import build_gateway


class Command(BaseCommand):
    help = ("Serve models behind an OpenAI-compatible API, recording attributed calls as spans "
            "(the model gateway).")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=settings.LLM_GATEWAY_HOST,
                            help="address to listen on (LLM_GATEWAY_HOST)")
        parser.add_argument("--port", type=int, default=settings.LLM_GATEWAY_PORT,
                            help="port (LLM_GATEWAY_PORT)")
        parser.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                            help="serve this checkpoint directory as NAME (repeatable)")
        parser.add_argument("--upstream", default=None, metavar="URL",
                            help="forward to this OpenAI-compatible server (e.g. vLLM's /v1)")
        parser.add_argument("--upstream-key", default=None, help="API key sent to --upstream")

    def handle(self, *args, **options) -> None:
        import sys

        import uvicorn

        # The port first: taken (another gateway, an earlier llm_serve still running), say so
        # now, not after loading the models, and never print an address this process lacks.
        listener = _listen(options["host"], options["port"])
        if settings.LLM_GATEWAY_SWITCH_INTERVAL_MS:  # this process's threads hand over sooner
            sys.setswitchinterval(settings.LLM_GATEWAY_SWITCH_INTERVAL_MS / 1000)
        try:
            gateway = build_gateway(models=options["model"], upstream_url=options["upstream"],
                                    upstream_key=options["upstream_key"],
                                    engine_process=settings.LLM_GATEWAY_ENGINE_PROCESS)
        except (ValueError, OSError) as exc:  # a bad NAME=PATH, a directory with no model
            listener.close()
            raise CommandError(f"cannot serve: {exc}") from None
        where = f"http://{options['host']}:{options['port']}/v1"
        mode = f"forwarding to {options['upstream']}" if options["upstream"] else (
            "models: " + (", ".join(gateway.registry.names()) or "those jobs publish"))
        self.stdout.write(f"model gateway on {where} ({mode})")
        config = uvicorn.Config(gateway.app(), host=options["host"], port=options["port"],
                                log_level="warning")
        try:
            uvicorn.Server(config).run(sockets=[listener])
        finally:
            gateway.close()  # the engine process too
            listener.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), as uvicorn would open it; CommandError when the
    address cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = (" (another gateway or llm_serve already listens there: stop it, or choose "
                "another port with --port or LLM_GATEWAY_PORT, and give agents that address "
                "in LLM_GATEWAY_URL)") if exc.errno == errno.EADDRINUSE else ""
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock
