"""Django's SQLite engine with this process's writers queued on a lock, not polling the file.

SQLite lets one writer at a time hold a database file. A connection that finds the file taken
waits in SQLite's busy handler (Python sqlite3's `timeout`), which sleeps and polls (1 ms up to
100 ms apart) and so is not a queue: with dozens of threads of one process writing (the
embedded default's rollout threads, the training thread, the sweep), a waiting writer sleeps
long after the lock is free, the writes that do get through run far apart, and some wait out
the whole timeout ("database is locked"). So here each write transaction first takes a lock of
this process per database file, before `BEGIN IMMEDIATE`, and gives it back when the
transaction commits, rolls back or its connection closes: a thread of this process blocks on
that lock and gets it, first come first served, the moment the writers before it are done.
A write outside a transaction (autocommit: `QuerySet.update()`, `Model.save()`) takes its turn
the same way for its statement; reads outside a transaction (SELECT) take none (WAL lets them
run beside the writer). Nested atomic blocks are savepoints inside the transaction that holds
the turn. Other processes on the same file (a `manage.py` command) are still kept apart by
SQLite's own lock and busy timeout, taken after this lock. A turn not had within the
connection's `timeout` raises "database is locked", as SQLite would.
"""

from __future__ import annotations

import threading
from collections import deque

from django.db.backends.sqlite3 import base as sqlite3_base
from django.db.utils import OperationalError

_locks: dict[str, FileLock] = {}
_locks_guard = threading.Lock()

# Statements that never write: run outside a transaction without a turn.
_READS = ("SELECT", "EXPLAIN")
SQLITE_DEFAULT_TIMEOUT = 5.0  # seconds: Python sqlite3's when OPTIONS give none


class FileLock:
    """A first-come first-served lock: released, it passes to the longest waiter, so a thread
    that writes often cannot take it again and again ahead of one that waits (a plain
    threading.Lock goes to whichever thread asks first after the release: most often the
    one that just gave it back, since it holds the GIL)."""

    def __init__(self) -> None:
        self._mutex, self._held, self._waiters = threading.Lock(), False, deque()

    def acquire(self, timeout: float) -> bool:
        with self._mutex:
            if not self._held:
                self._held = True
                return True
            handed = threading.Lock()
            handed.acquire()
            self._waiters.append(handed)
        if handed.acquire(timeout=timeout):
            return True
        with self._mutex:
            if handed in self._waiters:
                self._waiters.remove(handed)
                return False
        return True  # passed to this waiter between its timeout and the check

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()  # passed on: still held
            else:
                self._held = False


def _file_lock(name: str) -> FileLock:
    with _locks_guard:
        return _locks.setdefault(str(name), FileLock())


class WriteTurn:
    """One connection's hold on its database file's in-process write lock."""

    def __init__(self, lock: FileLock, timeout: float) -> None:
        self.lock, self.timeout, self.held = lock, timeout, False

    def take(self) -> bool:
        """Wait for the turn; False when this connection holds it already."""
        if self.held:
            return False
        if not self.lock.acquire(timeout=self.timeout):
            raise OperationalError(
                f"database is locked (no write turn within {self.timeout:g} s: another "
                f"thread of this process held a write transaction on the file)")
        self.held = True
        return True

    def give(self) -> None:
        if self.held:
            self.held = False
            self.lock.release()


class CursorWrapper(sqlite3_base.SQLiteCursorWrapper):
    """Takes the connection's write turn for a write run outside a transaction."""

    turn: WriteTurn

    def execute(self, query, params=None):
        with self._writing(query):
            return super().execute(query, params)

    def executemany(self, query, param_list):
        with self._writing(query):
            return super().executemany(query, param_list)

    def executescript(self, script):
        with self._writing(script):
            return super().executescript(script)

    def _writing(self, query: str) -> _Writing:
        reads = query.lstrip()[:7].upper().startswith(_READS)
        return _Writing(self, take=not (reads or self.connection.in_transaction))


class _Writing:
    def __init__(self, cursor: CursorWrapper, *, take: bool) -> None:
        self.cursor, self.take = cursor, take

    def __enter__(self) -> None:
        if self.take:
            self.cursor.turn.take()

    def __exit__(self, *exc) -> None:
        # A statement that left a transaction open (a raw BEGIN or SAVEPOINT, sqlite3's
        # implicit BEGIN with autocommit off) keeps the turn; one that ended it (a raw COMMIT
        # or RELEASE, a rollback SQLite did itself) gives it back.
        if self.cursor.turn.held and not self.cursor.connection.in_transaction:
            self.cursor.turn.give()


class DatabaseWrapper(sqlite3_base.DatabaseWrapper):
    turn: WriteTurn | None = None

    def get_new_connection(self, conn_params):
        connection = super().get_new_connection(conn_params)
        timeout = self.settings_dict["OPTIONS"].get("timeout", SQLITE_DEFAULT_TIMEOUT)
        self.turn = WriteTurn(_file_lock(self.settings_dict["NAME"]), float(timeout))
        return connection

    def create_cursor(self, name=None):
        cursor = self.connection.cursor(factory=CursorWrapper)
        cursor.turn = self.turn
        return cursor

    def _start_transaction_under_autocommit(self) -> None:
        self.turn.take()
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self.turn.give()
            raise

    def _commit(self):
        result = super()._commit()  # a failed COMMIT keeps the turn: the rollback gives it
        if self.turn and not (self.connection and self.connection.in_transaction):
            self.turn.give()
        return result

    def _rollback(self):
        try:
            return super()._rollback()
        finally:
            if self.turn:
                self.turn.give()

    def _close(self):
        try:
            return super()._close()
        finally:
            if self.turn:
                self.turn.give()
