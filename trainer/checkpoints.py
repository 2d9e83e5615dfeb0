"""Checkpoint files: written by the trainer, read by agents (through their resources).

A checkpoint is a resource of type ``checkpoint`` in the store's versioned resources::

    {"resource_type": "checkpoint", "storage": "checkpoints", "name": "jobs/1/step-3-ab12.pt",
     "uri": "checkpoints:jobs/1/step-3-ab12.pt", "sha256": "...", "format": "torch.save",
     "step": 3, "metrics": {...}}

The file goes through Django's storage API (the ``checkpoints`` entry of ``STORAGES``: the
filesystem under MEDIA_ROOT by default, object storage by setting). This module imports neither
the store's nor the trainer's models, so an agent on a runner can load the checkpoint its
rollout names without any import between ``runners`` and ``trainer``.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from django.core.files.base import ContentFile, File
from django.core.files.storage import storages

RESOURCE_TYPE = "checkpoint"
FORMAT = "torch.save"
DIR_FORMAT = "hf-dir"
# A directory checkpoint holding this file was written by torch.distributed.checkpoint (FSDP).
DCP_METADATA = ".metadata"  # a directory: safetensors weights, config and tokenizer files
STORAGE_ALIAS = "checkpoints"
_CACHE_SIZE = 8


class CheckpointError(Exception):
    """A checkpoint file is missing or its content does not match its sha256."""


def _storage(alias: str):
    return storages[alias]


def checkpoint_save(
    *, payload: dict[str, Any], name_prefix: str, step: int, metrics: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Serialize `payload` (tensors and plain data), store it under a content-addressed name,
    and return the checkpoint resource. Saving the same content twice writes one file."""
    import torch  # on first use: processes that never train never load torch

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    storage = _storage(STORAGE_ALIAS)
    name = f"{name_prefix}/step-{step}-{sha[:16]}.pt"
    if not storage.exists(name):
        stored = storage.save(name, ContentFile(data))
        if stored != name:  # a concurrent writer of the same content got there first
            storage.delete(stored)
    _cache_put(sha, payload)
    return {
        "resource_type": RESOURCE_TYPE,
        "storage": STORAGE_ALIAS,
        "name": name,
        "uri": f"{STORAGE_ALIAS}:{name}",
        "sha256": sha,
        "format": FORMAT,
        "size": len(data),
        "step": step,
        "metrics": metrics or {},
    }


def checkpoint_load(resource: dict[str, Any]) -> dict[str, Any]:
    """The payload of a checkpoint resource, verified against its sha256 and cached by it.
    Callers must not modify the tensors they get (they are shared through the cache)."""
    if resource.get("resource_type") != RESOURCE_TYPE:
        raise CheckpointError(f"not a checkpoint resource: {resource.get('resource_type')!r}")
    sha = resource["sha256"]
    cached = _cache_get(sha)
    if cached is not None:
        return cached
    if resource.get("format") == DIR_FORMAT and DCP_METADATA in (resource.get("files") or []):
        payload = _dcp_load(checkpoint_local_dir(resource))
        _cache_put(sha, payload)
        return payload
    storage = _storage(resource.get("storage", STORAGE_ALIAS))
    try:
        with storage.open(resource["name"], "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {resource['name']!r} is missing") from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise CheckpointError(f"checkpoint file {resource['name']!r} does not match its sha256")
    import torch

    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    _cache_put(sha, payload)
    return payload


def _dcp_load(directory: Path) -> dict[str, Any]:
    """The whole state a torch.distributed.checkpoint directory holds (an FSDP step's
    shards, written by every rank), as full tensors in this one process: no process group
    needed, so a world_size=1 step or an agent loads what world_size=N saved."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="lightning-dcp-load-") as tmp:
        dcp_to_torch_save(directory, Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", map_location="cpu", weights_only=True)


def checkpoint_delete(resource: dict[str, Any]) -> None:
    storage = _storage(resource.get("storage", STORAGE_ALIAS))
    for name in resource.get("files") or []:
        storage.delete(f"{resource['name']}/{name}")
    storage.delete(resource["name"])


def checkpoint_save_dir(
    *, directory: str | Path, name_prefix: str, step: int, metrics: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Store the files of a checkpoint directory (a Hugging Face model saved with
    `save_pretrained`, say) under a content-addressed directory name; returns the resource.
    `sha256` covers every file's name and content."""
    directory = Path(directory)
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0")
        digest.update(_file_sha(directory / name).encode())
    sha = digest.hexdigest()
    storage = _storage(STORAGE_ALIAS)
    name = f"{name_prefix}/step-{step}-{sha[:16]}"
    size = 0
    for file in files:
        target = f"{name}/{file}"
        size += (directory / file).stat().st_size
        if not storage.exists(target):
            with open(directory / file, "rb") as handle:
                stored = storage.save(target, File(handle))
            if stored != target:  # a concurrent writer of the same content got there first
                storage.delete(stored)
    return {
        "resource_type": RESOURCE_TYPE, "storage": STORAGE_ALIAS, "name": name,
        "uri": f"{STORAGE_ALIAS}:{name}", "sha256": sha, "format": DIR_FORMAT, "files": files,
        "size": size, "step": step, "metrics": metrics or {},
    }


def checkpoint_local_dir(resource: dict[str, Any]) -> Path:
    """A local directory holding a directory checkpoint's files: the storage's own directory
    when it is on this filesystem, else a copy under CHECKPOINT_CACHE_DIR (by content hash)."""
    if resource.get("format") != DIR_FORMAT:
        raise CheckpointError(f"not a directory checkpoint: {resource.get('format')!r}")
    storage = _storage(resource.get("storage", STORAGE_ALIAS))
    try:
        local = Path(storage.path(resource["name"]))
    except NotImplementedError:
        local = None
    if local is not None:
        missing = [f for f in resource["files"] if not (local / f).exists()]
        if missing:
            raise CheckpointError(f"checkpoint {resource['name']!r} lacks {missing}")
        return local
    from django.conf import settings

    cache = Path(settings.CHECKPOINT_CACHE_DIR) / resource["sha256"]
    if not (cache / ".complete").exists():
        cache.mkdir(parents=True, exist_ok=True)
        for file in resource["files"]:
            with storage.open(f"{resource['name']}/{file}", "rb") as src, \
                    open(cache / file, "wb") as dst:
                shutil.copyfileobj(src, dst)
        (cache / ".complete").touch()
    return cache


def _file_sha(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoints_prune(*, name_prefix: str, keep_names: set[str]) -> list[str]:
    """Delete the files under `name_prefix` that no kept version names (after retention
    deleted versions). Names are content-addressed, so a retried step's file is a kept one."""
    storage = _storage(STORAGE_ALIAS)
    try:
        dirs, files = storage.listdir(name_prefix)
    except FileNotFoundError:
        return []
    doomed = [f"{name_prefix}/{f}" for f in files if f"{name_prefix}/{f}" not in keep_names]
    for name in doomed:
        storage.delete(name)
    for folder in dirs:  # directory checkpoints (DIR_FORMAT)
        name = f"{name_prefix}/{folder}"
        if name not in keep_names:
            for file in storage.listdir(name)[1]:
                storage.delete(f"{name}/{file}")
            storage.delete(name)
            doomed.append(name)
    return doomed


def find_checkpoint(resources: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint among a rollout's resources (the first of its type)."""
    for value in resources.values():
        if isinstance(value, dict) and value.get("resource_type") == RESOURCE_TYPE:
            return value
    return None


# Runners load the version their rollout names; consecutive rollouts share versions, so a small
# in-process LRU keyed by content hash saves a read and a deserialization per rollout.
_cache: OrderedDict[str, dict[str, Any]] = OrderedDict()
_cache_lock = threading.Lock()


def _cache_get(sha: str) -> dict[str, Any] | None:
    with _cache_lock:
        payload = _cache.get(sha)
        if payload is not None:
            _cache.move_to_end(sha)
        return payload


def _cache_put(sha: str, payload: dict[str, Any]) -> None:
    with _cache_lock:
        _cache[sha] = payload
        _cache.move_to_end(sha)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
