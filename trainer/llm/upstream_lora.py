"""Upstream mode with LoRA: each adapter version a job publishes is loaded into the upstream
server through vLLM's runtime API, and each call goes to the version its rollout pinned.

A rollout whose `llm` resource names a LoRA checkpoint (grpo_lm with `lora`: its files hold
`lightning-lora.json`) is served by the upstream under a name of its own, `lora_name(...)`:
`p<project>/<resources id>/v<version>-<checkpoint sha256 prefix>`, so two tenants (or two jobs)
never share a name. The first call pinned to a version (or the poller, as soon as the version
is published) loads it: `POST {upstream}/load_lora_adapter` with that name and `lora_path` =
the checkpoint's local directory (trainer/checkpoints.py), which the upstream must read at that
same path: a shared filesystem. The call then goes out with `model` = that name.

Which version serves a call follows the local registry (registry.py): the pinned version k
while it is loaded, or when k is newer than every loaded version (it is loaded then);
otherwise the newest loaded version (the span records which). At most `keep` versions
(LLM_GATEWAY_MAX_VERSIONS) of one (project, resources id) stay loaded upstream: before a new
version loads, the older ones beyond `keep - 1` that no call in flight uses are unloaded
(`POST {upstream}/unload_lora_adapter`), and one still in use is unloaded when its last call
ends (so the upstream holds `keep`, or briefly more while old calls finish).

A load that fails is a 502 naming the upstream's answer, for that call and every call pinned to
that version until its retry time (1, 2, 4 ... 60 s after each failure): the upstream is not
asked again meanwhile. An unload that fails is logged and retried at the next unload.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from trainer.llm.openai_api import BadRequest

log = logging.getLogger(__name__)
MAX_BACKOFF = 60.0
_PLAIN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def is_lora(llm: dict[str, Any]) -> bool:
    from trainer.llm.lora import META

    checkpoint = llm.get("checkpoint")
    return isinstance(checkpoint, dict) and META in (checkpoint.get("files") or [])


def lora_name(project_id: int, resources_id: str, version: int, sha256: str = "") -> str:
    rid = resources_id if _PLAIN.fullmatch(resources_id) else \
        "h" + hashlib.sha256(resources_id.encode()).hexdigest()[:16]
    return f"p{project_id}/{rid}/v{version}" + (f"-{sha256[:12]}" if sha256 else "")


@dataclass(eq=False)
class _Adapter:
    name: str
    version: int
    loaded: bool = False
    in_flight: int = 0
    failures: int = 0
    retry_at: float = 0.0
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Lease:
    """A call's hold on an adapter version (released when the call is done)."""

    key: tuple[int, str]
    name: str
    version: int


class UpstreamLoRAs:
    def __init__(self, upstream: Any, *, keep: int = 2) -> None:
        self.upstream = upstream  # trainer.llm.upstream.Upstream
        self.keep = keep
        self._lock = threading.Lock()
        self._spaces: dict[tuple[int, str], dict[int, _Adapter]] = {}
        self._unload_later: set[str] = set()
        self.loads = self.unloads = 0
        self.first_backoff = 1.0  # seconds after a first failed load; doubled each time

    def loaded(self, project_id: int, resources_id: str) -> list[int]:
        with self._lock:
            return sorted(v for v, a in self._spaces.get((project_id, resources_id), {}).items()
                          if a.loaded)

    def acquire(self, project_id: int, resources_id: str, llm: dict[str, Any]) -> Lease:
        """The adapter serving a call pinned to `llm` (loaded into the upstream if need be),
        held until `release`."""
        key, version = (project_id, resources_id), int(llm.get("version") or 0)
        checkpoint = llm["checkpoint"]
        with self._lock:
            space = self._spaces.setdefault(key, {})
            loaded = [v for v, a in space.items() if a.loaded]
            pick = version if version in loaded else (
                max(loaded) if loaded and max(loaded) > version else None)
            if pick is not None:
                space[pick].in_flight += 1
                return Lease(key, space[pick].name, pick)
            adapter = space.get(version)
            if adapter is None:
                adapter = space[version] = _Adapter(
                    lora_name(project_id, resources_id, version,
                              str(checkpoint.get("sha256") or "")), version)
            adapter.in_flight += 1  # held from now: never unloaded under this call
        lease = Lease(key, adapter.name, version)
        if not adapter.loaded:  # room first: at most `keep` loaded once this one is
            self._collect(key, self.keep - 1)
        try:
            self._load(adapter, checkpoint)
        except BaseException:
            self.release(lease)
            raise
        self._collect(key)
        return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            adapter = self._spaces.get(lease.key, {}).get(lease.version)
            if adapter is not None and adapter.name == lease.name:
                adapter.in_flight -= 1
        self._collect(lease.key)

    def _load(self, adapter: _Adapter, checkpoint: dict[str, Any]) -> None:
        from trainer.checkpoints import checkpoint_local_dir

        with adapter.lock:  # one load per version; the others wait for it, then find it
            if adapter.loaded:
                return
            wait = adapter.retry_at - time.monotonic()
            if wait > 0:
                raise _failed(adapter, f"retrying in {wait:.0f} s")
            path = str(checkpoint_local_dir(checkpoint))  # CheckpointError: the caller's 422
            try:
                answer = self.upstream.client.post(
                    self.upstream.url + "/load_lora_adapter",
                    json={"lora_name": adapter.name, "lora_path": path})
                ok = answer.status_code == 200 or (
                    answer.status_code == 400 and "already been loaded" in answer.text)
                error = "" if ok else f"HTTP {answer.status_code}: {answer.text[:300]}"
            except httpx.HTTPError as exc:
                ok, error = False, f"{type(exc).__name__}: {exc}"
            if not ok:
                adapter.failures += 1
                backoff = min(self.first_backoff * 2.0 ** (adapter.failures - 1), MAX_BACKOFF)
                adapter.retry_at, adapter.error = time.monotonic() + backoff, error
                log.warning("loading LoRA adapter %s into the upstream failed (%s); retrying "
                            "in %.0f s", adapter.name, error, backoff)
                raise _failed(adapter, f"retrying in {backoff:.0f} s")
            adapter.loaded, adapter.failures, adapter.error = True, 0, ""
            self.loads += 1
            log.info("LoRA adapter %s loaded into the upstream from %s", adapter.name, path)

    def _collect(self, key: tuple[int, str], keep: int | None = None) -> None:
        """Unload the versions beyond the newest `keep` that no call in flight uses."""
        keep = self.keep if keep is None else keep
        with self._lock:
            space = self._spaces.get(key, {})
            loaded = sorted((v for v, a in space.items() if a.loaded), reverse=True)
            doomed = [space.pop(v) for v in loaded[keep:] if space[v].in_flight == 0]
            names = {a.name for a in doomed} | self._unload_later
            self._unload_later = set()
        for name in sorted(names):
            try:
                answer = self.upstream.client.post(self.upstream.url + "/unload_lora_adapter",
                                                   json={"lora_name": name})
                ok = answer.status_code in (200, 404)  # 404: already gone
            except httpx.HTTPError:
                ok = False
            if ok:
                self.unloads += 1
                log.info("LoRA adapter %s unloaded from the upstream", name)
            else:
                log.warning("unloading LoRA adapter %s from the upstream failed; retried at "
                            "the next unload", name)
                with self._lock:
                    self._unload_later.add(name)


def _failed(adapter: _Adapter, when: str) -> BadRequest:
    return BadRequest(f"loading LoRA adapter '{adapter.name}' (version {adapter.version}) into "
                      f"the upstream server failed: {adapter.error}; {when}", "model",
                      status=502, code="upstream_lora_load_failed", kind="upstream_error")
