"""gunicorn's access log without secrets (set as `logger_class` in gunicorn_conf).

gunicorn logs the user name of HTTP Basic auth (`%(u)s`, and AGL's client puts `user:KEY`
in its URL, where a key may well sit in the user part) and the whole request line with its
query string; a key there would be kept in every log. Here the user is always `-`, key-like
query parameters read `REDACTED` (in the request line, the query string and the referer),
and the Authorization and Cookie request headers, if a log format names them, `-`."""

from __future__ import annotations

import re

from gunicorn.glogging import Logger

_SECRET_PARAMS = re.compile(r"(?i)((?:^|[?&;])(?:key|api_key|apikey|token|access_token)=)[^&;\s]*")
_SECRET_HEADERS = ("{authorization}i", "{proxy-authorization}i", "{cookie}i", "{x-api-key}i")


def redact_query(text: str | None) -> str | None:
    return _SECRET_PARAMS.sub(r"\1REDACTED", text) if text else text


class RedactingLogger(Logger):
    def atoms(self, resp, req, environ, request_time) -> dict:
        atoms = super().atoms(resp, req, environ, request_time)
        atoms["u"] = "-"
        for name in ("r", "q", "f"):
            atoms[name] = redact_query(atoms.get(name))
        for name in _SECRET_HEADERS:
            if name in atoms:
                atoms[name] = "-"
        return atoms
