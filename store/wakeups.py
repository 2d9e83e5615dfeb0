"""Wake-ups for waiting requests, over Postgres LISTEN/NOTIFY.

A request that waits (`wait_for_rollouts`, a dequeue's long-poll) checks the database, then
sleeps until a writer announces a change in its project or a fallback interval passes, and
checks again. Writers announce inside their transaction (`announce`); Postgres delivers the
notification at commit, so whoever wakes up sees the change. One listener thread per process
holds its own connection and counts notifications per (channel, project); a waiter takes the
count (`token`) before its check and sleeps until the count moves, so a notification that
lands between the check and the sleep is never lost.

Without Postgres (the embedded SQLite default), or while the listener is (re)connecting,
waiters fall back to sleeping a short interval between checks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

from django.db import connection

log = logging.getLogger(__name__)

QUEUED = "lightning_queued"  # rollouts became queued (enqueue, requeue)
FINISHED = "lightning_finished"  # rollouts became terminal
CHANNELS = (QUEUED, FINISHED)

# Re-check at least this often even when no notification came (a notification sent while the
# listener was reconnecting is lost); and how long to sleep between checks without a listener.
CHECK_EVERY_SECONDS = 5.0
FALLBACK_POLL_SECONDS = 0.25


def announce(channel: str, project_id: int) -> None:
    """Tell waiting requests of every process that `channel` changed in a project. Call
    inside the writing transaction: Postgres delivers at commit (and drops it on rollback)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [channel, str(project_id)])


def announce_statement(notices: list[tuple[str, int]]) -> tuple[str, list] | None:
    """`announce` for each (channel, project id), as one statement for a writer to send with
    its last write (store/services/_bulk.write_together's `last`); None when there is
    nothing to send or the database is not Postgres."""
    if not notices or connection.vendor != "postgresql":
        return None
    params: list = []
    for channel, project_id in notices:
        params += [channel, str(project_id)]
    return "SELECT " + ", ".join(["pg_notify(%s, %s)"] * len(notices)), params


class _Listener(threading.Thread):
    def __init__(self, params: dict) -> None:
        super().__init__(name="store-wakeups", daemon=True)
        self._params = params
        self._counts: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._changed = threading.Condition()
        # Waits on event loops (store/waits.py): key -> [(loop, future, token)].
        self._async: defaultdict[tuple[str, str], list] = defaultdict(list)
        self.listening = threading.Event()
        self.stopping = threading.Event()

    def token(self, channel: str, project_id: int) -> int:
        with self._changed:
            return self._counts[(channel, str(project_id))]

    def wait(self, channel: str, project_id: int, token: int, timeout: float) -> bool:
        """Sleep until a notification for the project after `token`, or `timeout`."""
        key = (channel, str(project_id))
        with self._changed:
            return self._changed.wait_for(lambda: self._counts[key] != token, timeout)

    async def wait_async(self, channel: str, project_id: int, token: int,
                         timeout: float) -> None:
        """`wait` for an event loop: the listener thread wakes the future; no thread sleeps."""
        import asyncio

        key = (channel, str(project_id))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        entry = (loop, future, token)
        with self._changed:
            if self._counts[key] != token:
                return
            self._async[key].append(entry)
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            pass
        finally:
            with self._changed:
                waiting = self._async.get(key)
                if waiting and entry in waiting:
                    waiting.remove(entry)
                    if not waiting:
                        del self._async[key]

    def _wake_async(self, key: tuple[str, str]) -> None:
        for loop, future, _ in self._async.pop(key, ()):
            loop.call_soon_threadsafe(_resolve, future)

    def run(self) -> None:
        import psycopg

        backoff = 0.5
        while not self.stopping.is_set():
            try:
                with psycopg.connect(**self._params, autocommit=True) as conn:
                    for channel in CHANNELS:
                        conn.execute(f"LISTEN {channel}")
                    self.listening.set()
                    backoff = 0.5
                    while not self.stopping.is_set():
                        for note in conn.notifies(timeout=1.0):
                            key = (note.channel, note.payload)
                            with self._changed:
                                self._counts[key] += 1
                                self._changed.notify_all()
                                self._wake_async(key)
            except Exception:  # a dropped connection: waiters poll until we are back
                self.listening.clear()
                log.warning("store wake-ups: listener connection lost; reconnecting",
                            exc_info=True)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        self.listening.clear()


def _resolve(future) -> None:  # noqa: ANN001 - an asyncio.Future
    if not future.done():
        future.set_result(None)


_listener: _Listener | None = None
_listener_lock = threading.Lock()


def _get_listener() -> _Listener | None:
    global _listener
    if connection.vendor != "postgresql":
        return None
    with _listener_lock:
        if _listener is None or not _listener.is_alive() or _listener.stopping.is_set():
            params = dict(connection.get_connection_params())
            params.pop("cursor_factory", None)
            _listener = _Listener(params)
            _listener.start()
        return _listener


def stop_listener() -> None:
    """Close this process's listener connection (before dropping its database, say); the
    next waiter starts a new one."""
    global _listener
    with _listener_lock:
        listener, _listener = _listener, None
    if listener is not None:
        listener.stopping.set()
        listener.join(timeout=10)


class Waiter:
    """For one waiting request: `start()` before each check of the database, then `sleep()`
    until the channel moves in the project, `CHECK_EVERY_SECONDS` pass, or `remaining` ends."""

    def __init__(self, channel: str, project_id: int) -> None:
        self.channel, self.project_id = channel, project_id
        self._listener = _get_listener()
        self._token = 0

    @property
    def token(self) -> int:
        return self._token

    def start(self) -> None:
        if self._listener is not None:
            self._token = self._listener.token(self.channel, self.project_id)

    def sleep(self, remaining: float) -> None:
        if remaining <= 0:
            return
        listener = self._listener
        if listener is None or not listener.listening.is_set():
            time.sleep(min(remaining, FALLBACK_POLL_SECONDS))
            return
        listener.wait(self.channel, self.project_id, self._token,
                      min(remaining, CHECK_EVERY_SECONDS))


async def sleep_async(channel: str, project_id: int, token: int, remaining: float) -> None:
    """`Waiter.sleep` for an event loop (store/waits.py): until the channel moves in the
    project after `token`, `CHECK_EVERY_SECONDS` pass, or `remaining` ends."""
    import asyncio

    if remaining <= 0:
        return
    listener = _listener
    if listener is None or not listener.is_alive() or not listener.listening.is_set():
        await asyncio.sleep(min(remaining, FALLBACK_POLL_SECONDS))
        return
    await listener.wait_async(channel, project_id, token, min(remaining, CHECK_EVERY_SECONDS))
