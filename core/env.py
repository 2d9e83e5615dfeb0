"""Typed readers for settings that come from the environment; bad values fail loudly."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no)")


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be >= {minimum}")
    return value


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be >= {minimum}")
    return value


def env_prices(name: str, default: dict[str, float]) -> dict[str, float]:
    """`name=price,name=price` (a price >= 0 each; `*` names the default), in the given order."""
    raw = os.environ.get(name)
    if raw is None:
        return dict(default)
    prices: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.rpartition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not key.strip() or price < 0:
            raise ImproperlyConfigured(f"{name}={raw!r}: {item!r} is not name=price (price >= 0)")
        prices[key.strip()] = price
    return prices


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def database_from_url(url: str) -> dict:
    """Parse DATABASE_URL (postgres://user:pass@host:port/name?opt=v or sqlite:///path)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    options = dict(parse_qsl(parts.query))
    if scheme in {"postgres", "postgresql", "pgsql"}:
        name = unquote(parts.path.lstrip("/"))
        if not name:
            raise ImproperlyConfigured(f"DATABASE_URL {url!r} names no database")
        try:
            port = parts.port
        except ValueError:
            raise ImproperlyConfigured(f"DATABASE_URL {url!r} has a bad port") from None
        raw_age = options.pop("conn_max_age", "60")
        if not raw_age.isdigit():
            raise ImproperlyConfigured(
                f"DATABASE_URL option conn_max_age must be a whole number of seconds, "
                f"not {raw_age!r}"
            )
        conn_max_age = int(raw_age)
        health_checks = options.pop("conn_health_checks", "true").lower()
        if health_checks not in {"true", "false"}:
            raise ImproperlyConfigured(
                "DATABASE_URL option conn_health_checks must be true or false, "
                f"not {health_checks!r}"
            )
        prepared = options.pop("prepared_statements", "true").lower()
        if prepared not in {"true", "false"}:
            raise ImproperlyConfigured(
                "DATABASE_URL option prepared_statements must be true or false, "
                f"not {prepared!r}"
            )
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(port or ""),
            # Reuse connections across requests; health checks (one `SELECT 1` per request)
            # drop ones the server closed instead of failing that request.
            "CONN_MAX_AGE": conn_max_age,
            "CONN_HEALTH_CHECKS": health_checks == "true",
            # Statements are bound by the server, and one a connection runs 5 times is
            # prepared there (psycopg's prepare_threshold; the OTLP export's at once,
            # store/services/_rows.py): the store's hot statements are parsed and planned once
            # per connection, not per call. Django's default sends each statement as text
            # with its values quoted in, planned every time: the key lookup cost Postgres
            # 122 us a request that way, 22 us prepared. `false` behind a pooler that cannot
            # keep prepared statements (PgBouncer before 1.21 in transaction mode): still
            # bound by the server, never prepared.
            "PREPARED_STATEMENTS": prepared == "true",
            "OPTIONS": {**options, "server_side_binding": True,
                        "prepare_threshold": 5 if prepared == "true" else None},
        }
    if scheme == "sqlite":
        path = unquote(parts.path)
        if not path:
            raise ImproperlyConfigured(f"DATABASE_URL {url!r} names no file")
        return sqlite_database(Path(path))
    raise ImproperlyConfigured(
        f"DATABASE_URL scheme {scheme!r} is not supported (use postgres:// or sqlite://)"
    )


def sqlite_database(path: Path) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    return {
        "ENGINE": "core.sqlite_engine",  # Django's, with the writers of this process queued
        "NAME": str(path),
        # Seconds a writer waits for the lock before "database is locked".
        "OPTIONS": {
            "timeout": 30,
            # BEGIN IMMEDIATE takes the write lock up front, so concurrent writers queue
            # instead of failing on a lock upgrade halfway through a transaction.
            "transaction_mode": "IMMEDIATE",
            # WAL lets readers run beside the single writer; NORMAL sync is safe under WAL.
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
        "TEST": {"NAME": str(path.with_name(path.stem + "-test.sqlite3"))},
    }
