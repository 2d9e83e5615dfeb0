"""What a training step needs and what a worker has: job config `resources` (issue 25).

A job may declare `resources: {"gpus": 2, "gpu_memory_gb": 40, "gpu_type": "A100"}` (each
optional). Its steps are trained only by a worker holding that many CUDA devices of one type
(the device name contains `gpu_type`, case-insensitive), each with at least `gpu_memory_gb`
GiB (2**30 bytes, as torch reports total memory). The check is a claim filter: the worker
that took the step's message checks its own devices before it claims (trainer.services.
step_claim), and one that does not fit leaves the step to another.

A worker's devices are torch's CUDA devices, or, where `WORKERS_CUDA_DEVICES` is set (JSON,
e.g. `[{"name": "NVIDIA A100-SXM4-80GB", "memory_gb": 80}]`), those: for tests and for
describing a CPU machine as something else. The registry (runners) records the same list, so
what a worker registers is what it claims with.

This module is kernel: runners (registration) and trainer (claims, waiting reasons) both use
it, and it imports neither.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GIB = 2**30
RESOURCE_FIELDS = ("gpus", "gpu_memory_gb", "gpu_type")
MAX_GPUS = 64

Device = dict[str, Any]  # {"index": 0, "name": "NVIDIA H100", "total_memory": bytes}


class ResourcesError(ValueError):
    """A bad `resources` value: `field` is the dotted field under `resources`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Resources:
    gpus: int = 0
    gpu_memory_gb: float = 0.0
    gpu_type: str = ""

    @property
    def any(self) -> bool:
        return bool(self.gpus or self.gpu_memory_gb or self.gpu_type)

    def describe(self) -> str:
        """"2 GPUs with >= 40 GB of type A100"; "no GPU" when nothing is asked."""
        if not self.any:
            return "no GPU"
        count = self.gpus or 1
        text = f"{count} GPU{'s' if count != 1 else ''}"
        if self.gpu_memory_gb:
            text += f" with >= {self.gpu_memory_gb:g} GB"
        if self.gpu_type:
            text += f" of type {self.gpu_type}"
        return text


def resources_parse(value: Any) -> Resources:
    """The job config's `resources` (None or {} when absent); ResourcesError names the field."""
    if value is None:
        return Resources()
    if not isinstance(value, dict):
        raise ResourcesError("resources", f"must be an object with {', '.join(RESOURCE_FIELDS)}, "
                             f"got {type(value).__name__}")
    unknown = sorted(set(value) - set(RESOURCE_FIELDS))
    if unknown:
        raise ResourcesError(f"resources.{unknown[0]}",
                             f"unknown field (known: {', '.join(RESOURCE_FIELDS)})")
    gpus = value.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
        raise ResourcesError("resources.gpus", f"must be an integer from 0 to {MAX_GPUS}, "
                             f"got {gpus!r}")
    memory = value.get("gpu_memory_gb", 0)
    if isinstance(memory, bool) or not isinstance(memory, int | float) or memory < 0:
        raise ResourcesError("resources.gpu_memory_gb",
                             f"must be a number of GB >= 0, got {memory!r}")
    kind = value.get("gpu_type", "")
    if isinstance(kind, list | tuple | set):
        raise ResourcesError("resources.gpu_type",
                             f"one job's GPUs are one type (its ranks run in lockstep, the "
                             f"slowest sets the pace); mixed types are refused, got "
                             f"{list(kind)!r}")
    if not isinstance(kind, str):
        raise ResourcesError("resources.gpu_type", f"must be a string, got {kind!r}")
    return Resources(gpus=gpus, gpu_memory_gb=float(memory), gpu_type=kind.strip())


def fits(devices: Sequence[Device], need: Resources) -> bool:
    """`devices` hold `need`: at least `gpus` (1 when memory or a type is asked) devices of
    one name (one type) containing `gpu_type`, each with >= `gpu_memory_gb` GiB."""
    if not need.any:
        return True
    wanted = need.gpus or 1
    suitable = Counter(
        str(d.get("name", "")) for d in devices
        if int(d.get("total_memory", 0)) >= need.gpu_memory_gb * GIB
        and need.gpu_type.lower() in str(d.get("name", "")).lower())
    return any(count >= wanted for count in suitable.values())


def describe_devices(devices: Sequence[Device]) -> str:
    """"2 x 80 GB NVIDIA A100" (one group per name and size); "no GPU"."""
    if not devices:
        return "no GPU"
    groups = Counter((str(d.get("name", "")), round(int(d.get("total_memory", 0)) / GIB))
                     for d in devices)
    return " + ".join(f"{count} x {gb} GB {name}".rstrip()
                      for (name, gb), count in sorted(groups.items()))


def unmet_reason(need: Resources, workers: Sequence[tuple[str, Sequence[Device]]]) -> str | None:
    """Why no live training worker (name, devices) can take a step needing `need`; None when
    one can. "needs 2 GPUs with >= 40 GB; live training workers: 1 x 24 GB NVIDIA L4"."""
    if any(fits(devices, need) for _, devices in workers):
        return None
    if not workers:
        return f"needs {need.describe()}; no live training worker"
    have = "; ".join(f"{name}: {describe_devices(devices)}" for name, devices in workers)
    return f"needs {need.describe()}; live training workers: {have}"


def parse_override(raw: str | None) -> list[Device] | None:
    """WORKERS_CUDA_DEVICES: a JSON list of {"name", "memory_gb"} (or "total_memory" in
    bytes); None when unset. ValueError says what is wrong."""
    if raw is None or not raw.strip():
        return None
    try:
        items = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"is not JSON ({exc})") from None
    if not isinstance(items, list):
        raise ValueError("must be a JSON list of {\"name\": ..., \"memory_gb\": ...}")
    devices = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"item {index} must be an object with a string \"name\"")
        memory = item.get("total_memory", item.get("memory_gb", 0) * GIB
                          if isinstance(item.get("memory_gb", 0), int | float) else None)
        if isinstance(memory, bool) or not isinstance(memory, int | float) or memory < 0:
            raise ValueError(f"item {index}: memory_gb must be a number >= 0")
        devices.append({"index": index, "name": item["name"], "total_memory": int(memory)})
    return devices


def local_devices() -> list[Device]:
    """This process's CUDA devices (WORKERS_CUDA_DEVICES where set): what a worker registers
    and what it claims with."""
    from django.conf import settings

    if settings.WORKERS_CUDA_DEVICES is not None:
        return [dict(d) for d in settings.WORKERS_CUDA_DEVICES]
    import torch  # here: processes that never train or register never load torch

    if not torch.cuda.is_available():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append({"index": index, "name": props.name, "total_memory": props.total_memory})
    return devices
