#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_site.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db.utils import OperationalError, ProgrammingError

    try:
        execute_from_command_line(sys.argv)
        sys.stdout.flush()  # here, where a reader that went away is handled below
    except ImproperlyConfigured as exc:
        # A bad setting (settings name the variable): say which, without a traceback.
        sys.exit(f"error: {exc}")
    except BrokenPipeError:
        # The reader went away (`./lightning train_list | head`): stop quietly, as Unix tools
        # do, with stdout pointed at /dev/null so the interpreter's own flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except (OperationalError, ProgrammingError) as exc:
        hint = database_hint(exc)
        if hint is None:
            raise
        sys.exit(f"error: {hint}")


def database_hint(exc: Exception) -> str | None:
    """One line for a database that is missing, unreachable or not migrated; None for any
    other database error (those keep their traceback)."""
    from django.db import connection

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = connection.settings_dict.get("NAME")
    if "no such table" in text or ("relation" in text and "does not exist" in text):
        return (f"the database {where!r} has no table for this ({text}); create or update its "
                f"tables with: ./lightning migrate")
    if "database" in text and "does not exist" in text:
        return f"{text}; create it (createdb {where}), then run: ./lightning migrate"
    if "connection" in text and ("refused" in text or "failed" in text):
        return f"cannot reach the database: {text} (is PostgreSQL running? DATABASE_URL?)"
    return None


if __name__ == "__main__":
    main()
