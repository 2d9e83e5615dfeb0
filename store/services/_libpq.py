"""One statement run through libpq itself, for the hottest statements (`_rows.
fetch_one_prepared`: a lean request's one statement).

A psycopg cursor runs a statement as a generator driven by a wait loop (send, flush, poll,
read, one Python step each), and makes a cursor, a transformer and a result wrapper per
run: about 120 us of CPU for the `spans/next` statement, against 60 as one libpq call (of a
`spans/next` request's 300 or so in the web process; README "Tenth pass on AGL's runner
mix").
Here a statement already prepared on the connection is one call of libpq's
`PQexecPrepared` (`PGconn.exec_prepared`, which releases the GIL while it waits), with the
parameters dumped and the row loaded by the connection's own adapters (Django's loaders
included), so the values are those a cursor gives.

Only in autocommit with no transaction open (a statement that is its own transaction):
inside Django's `atomic` psycopg opens the transaction with the first statement a cursor
runs, which libpq called directly would not do. The caller falls back to a cursor then.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Any

import psycopg
from psycopg import errors, pq
from psycopg.adapt import PyFormat, Transformer

_IDLE = pq.TransactionStatus.IDLE
_BAD = pq.ConnStatus.BAD
_DONE = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)
_SQLSTATE = pq.DiagnosticField.SQLSTATE
_NO_SUCH_NAME = errors.InvalidSqlStatementName.sqlstate.encode()  # 26000


class _State:
    """What one connection keeps: its transformer (its adapters, dumpers cached by type)
    and the names of the statements prepared on it, per text and parameter types."""

    __slots__ = ("transformer", "names", "counter")

    def __init__(self, raw: psycopg.Connection) -> None:
        self.transformer = Transformer(raw)
        self.names: OrderedDict[tuple[bytes, tuple], bytes] = OrderedDict()  # oldest first
        self.counter = itertools.count()


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_PREPARED = 100  # statements prepared per connection, the least recently run dropped


def usable(raw: psycopg.Connection) -> bool:
    """Whether `run_one` may run a statement on `raw` now: autocommit, no transaction open,
    no pipeline."""
    return raw.autocommit and raw.pgconn.transaction_status == _IDLE \
        and getattr(raw, "_pipeline", None) is None


def run_one(raw: psycopg.Connection, sql: bytes, params: list, prepare: bool) -> tuple | None:
    """Run `sql` (Postgres' own placeholders) with `params`: its first row, or None.
    `prepare`: prepared on the connection at its first run (a name of this module's own,
    apart from psycopg's), else bound by the server unnamed each time (a pooler that keeps
    no prepared statements). Errors are psycopg's, as a cursor raises them."""
    state = _states.get(raw)
    if state is None:
        state = _states[raw] = _State(raw)
    tx = state.transformer
    with raw.lock:
        values = tx.dump_sequence(params, [PyFormat.AUTO] * len(params))
        pgconn = raw.pgconn
        if prepare:
            types = tx.types
            result = _exec_prepared(raw, state, sql, types, values, tx.formats)
            if result.status not in _DONE and result.error_field(_SQLSTATE) == _NO_SUCH_NAME:
                # Deallocated under us (psycopg sends DEALLOCATE ALL after a rollback, a
                # DROP or an ALTER, so its own names and ours are gone): nothing ran;
                # prepared again, once.
                state.names.clear()
                result = _exec_prepared(raw, state, sql, types, values, tx.formats)
        else:
            result = pgconn.exec_params(sql, values, tx.types, tx.formats)
        _check(raw, result)
        if not result.ntuples:
            return None
        tx.set_pgresult(result)
        try:
            return tx.load_row(0, tuple)
        finally:
            tx.set_pgresult(None)


def _exec_prepared(raw: psycopg.Connection, state: _State, sql: bytes, types: tuple,
                   values: list, formats: list) -> Any:
    """The statement run under its name on this connection, prepared first if it has none."""
    pgconn = raw.pgconn
    names = state.names
    name = names.get((sql, types))
    if name is None:
        if len(names) >= MAX_PREPARED:
            # As psycopg bounds its own (prepared_max): an export's statement is one per
            # batch size and parameter types, each plan held by the server.
            done = pgconn.exec_(b"DEALLOCATE " + names.popitem(last=False)[1])
            if done.status not in _DONE:
                if done.error_field(_SQLSTATE) != _NO_SUCH_NAME:
                    _check(raw, done)
                names.clear()  # a DEALLOCATE ALL took them all
        name = b"_lx%d" % next(state.counter)
        _check(raw, pgconn.prepare(name, sql, types))
        names[(sql, types)] = name
    else:
        names.move_to_end((sql, types))
    result = pgconn.exec_prepared(name, values, formats)
    if result.status not in _DONE:
        # A name whose plan the server refuses now (a table altered under it), or one gone:
        # the next run prepares the statement afresh, under a new name.
        state.names.pop((sql, types), None)
    return result


def _check(raw: psycopg.Connection, result: Any) -> None:
    if result.status in _DONE:
        return
    if raw.pgconn.status == _BAD:
        # The connection was lost (libpq's own error result, without a SQLSTATE): an
        # OperationalError, as a cursor raises it, which callers' retries and Django's
        # connection handling know for a connection to drop and open again.
        raise errors.OperationalError(result.error_message.decode(raw.info.encoding,
                                                                  "replace").strip())
    raise errors.error_from_result(result, encoding=raw.info.encoding)
