"""What this machine has: CPUs, CUDA devices and their memory (through torch), versions."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

import torch

from core.devices import local_devices

_PACKAGES = ("lightning-orchestrator", "celery", "kombu", "Django", "torch")


def cuda_devices() -> list[dict[str, Any]]:
    """torch's CUDA devices, or WORKERS_CUDA_DEVICES where set (core/devices.py)."""
    return local_devices()


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    found["cuda"] = torch.version.cuda or ""
    return found


def describe() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count() or 1, "cuda_devices": cuda_devices(),
            "versions": versions()}
