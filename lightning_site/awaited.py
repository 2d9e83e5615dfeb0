"""The ASGI front's awaited connections: a few asynchronous psycopg connections per server
process, on which the event loop runs a lean request's one statement that commits
synchronously (`spans/next`, the verdict: store/api/fastjson.py AWAITED_ROUTES) and awaits it,
WAL flush included, without holding the loop or a thread (lightning_site/asgi.py).

Each connection is in autocommit with the server's defaults (`synchronous_commit` as the
database has it: on), with Django's own connection parameters and adapters (rows read as
Django's connections read them) and its time zone. At most `size` are open; a statement that
finds none idle raises Busy (the caller hands the request to a thread, as before). A
connection that failed, or is left in a transaction, is closed, the next call opens another.
"""

from __future__ import annotations

import logging

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections
from psycopg.pq import TransactionStatus

log = logging.getLogger(__name__)


class Busy(Exception):
    """Every awaited connection is in use (or none could be opened)."""


class AwaitedConnections:
    def __init__(self, size: int, alias: str = DEFAULT_DB_ALIAS) -> None:
        self.size, self.alias = size, alias
        self._idle: list[psycopg.AsyncConnection] = []
        self._open = 0
        self._params: dict | None = None
        self.prepare = True

    def _connection_params(self) -> dict:
        if self._params is None:
            db = connections[self.alias]
            params = db.get_connection_params()  # Django's, with its adapters ("context")
            params.pop("cursor_factory", None)  # a sync class; statements run raw here
            params["prepare_threshold"] = 2**31 - 1  # only what asks for it (prepare=True)
            params["autocommit"] = True
            self.prepare = db.settings_dict.get("PREPARED_STATEMENTS", True)
            self._params = params
        return self._params

    async def _take(self) -> psycopg.AsyncConnection:
        if self._idle:
            return self._idle.pop()
        if self._open >= self.size:
            raise Busy
        self._open += 1
        try:
            conn = await psycopg.AsyncConnection.connect(**self._connection_params())
            zone = connections[self.alias].timezone_name
            if zone and conn.info.parameter_status("TimeZone") != zone:
                await conn.execute("SELECT set_config('TimeZone', %s, false)", [zone])
        except Exception as exc:
            self._open -= 1
            log.debug("awaited connection: could not open one", exc_info=True)
            raise Busy from exc
        return conn

    def _give(self, conn: psycopg.AsyncConnection) -> None:
        if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
            self._open -= 1
            if not conn.closed:
                conn.pgconn.finish()  # no await: nothing left to say to the server
            return
        self._idle.append(conn)

    async def fetch_one(self, sql: bytes, params: list) -> tuple | None:
        """Run one statement (Postgres' own `$n` placeholders, server-side binding, prepared
        once per connection) in autocommit: its first row. Busy when no connection is free;
        a database error as psycopg raises it (the statement, its own transaction, stored
        nothing)."""
        conn = await self._take()
        try:
            async with psycopg.AsyncRawCursor(conn) as cursor:
                await cursor.execute(sql, params, prepare=self.prepare)
                return await cursor.fetchone()
        finally:
            self._give(conn)

    async def close(self) -> None:
        while self._idle:
            conn = self._idle.pop()
            self._open -= 1
            await conn.close()
