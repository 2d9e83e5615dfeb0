"""Text the database cannot store: a NUL character (Postgres refuses it in text and in JSON)
or a lone UTF-16 surrogate (`"\\ud800"` in JSON; it has no UTF-8 encoding). Looked for only
after the database or the driver refused a write, so the answer can name the field at fault
without costing every request a walk over its values."""

from __future__ import annotations

from typing import Any


def text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "contains a NUL character, which the store cannot keep"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate (not valid Unicode)"
    return None


def find_bad_text(value: Any, loc: tuple = ()) -> tuple[tuple, str] | None:
    """The location (keys and list indexes) of the first string in `value` that the store
    cannot keep, and why; None when there is none."""
    if isinstance(value, str):
        problem = text_problem(value)
        return (loc, problem) if problem else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and (problem := text_problem(key)):
                return (*loc, key), f"key {problem}"
            found = find_bad_text(item, (*loc, key))
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = find_bad_text(item, (*loc, index))
            if found:
                return found
    return None
