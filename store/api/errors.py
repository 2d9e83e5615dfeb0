"""Errors as HTTP: store errors and bad input get their status and a short JSON detail;
nothing a client sends yields a 500 or a traceback. A database that is down or restarting
(or a deadlock that rolled a request back) answers 503 with `Retry-After`: the request is safe
to repeat, and clients do (runners/client.py).

Bodies: `{"detail": "message"}`, except validation errors (422), which use FastAPI's shape
as AGL 0.3 does: `{"detail": [{"loc": ["body", "field", ...], "msg": "...", "type": "..."}]}`,
where `loc` starts with where the field was: `body`, `query` (query parameters) or `path`.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.db import DataError, InterfaceError, OperationalError
from django.http import Http404
from psycopg import DataError as PgDataError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from store.errors import (
    FieldFrozen,
    IllegalTransition,
    InvalidInput,
    NotFound,
    ResourceInUse,
    StoreError,
)
from store.text import find_bad_text

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "request too large"
    default_code = "payload_too_large"


class UnsupportedMediaType(exceptions.APIException):
    status_code = status.HTTP_415_UNSUPPORTED_MEDIA_TYPE
    default_detail = "unsupported content type"
    default_code = "unsupported_media_type"


def _flatten(detail: Any, loc: list[Any]) -> list[dict[str, Any]]:
    if isinstance(detail, dict):
        out: list[dict[str, Any]] = []
        for key, value in detail.items():
            out += _flatten(value, loc if key == "non_field_errors" else loc + [key])
        return out
    if isinstance(detail, list):
        if all(isinstance(item, str) for item in detail):
            return [_item(loc, item) for item in detail]
        out = []
        for index, value in enumerate(detail):
            if value:
                out += _flatten(value, loc + [index])
        return out
    return [_item(loc, detail)]


def _item(loc: list[Any], message: Any) -> dict[str, Any]:
    code = getattr(message, "code", "invalid")
    return {"loc": loc, "msg": str(message), "type": str(code)}


def validation_response(detail: Any, where: str = "body",
                        path_params: Any = ()) -> Response:
    """422 naming each field at fault; a field that is a path parameter is under `path`."""
    if isinstance(detail, dict) and path_params:
        in_path = {k: v for k, v in detail.items() if k in path_params}
        rest = {k: v for k, v in detail.items() if k not in path_params}
        items = _flatten(in_path, ["path"]) + (_flatten(rest, [where]) if rest else [])
        return Response({"detail": items}, status=422)
    return Response({"detail": _flatten(detail, [where])}, status=422)


def _where(context: dict[str, Any]) -> tuple[str, Any]:
    """Where the view read its input (`body` or `query`) and its path parameters' names."""
    view = context.get("view")
    return getattr(view, "validation_location", "body"), context.get("kwargs") or {}


def _store_error(exc: StoreError, context: dict[str, Any]) -> Response:
    if isinstance(exc, NotFound):
        return Response({"detail": str(exc)}, status=404)
    if isinstance(exc, IllegalTransition | ResourceInUse | FieldFrozen):
        return Response({"detail": str(exc)}, status=409)
    if isinstance(exc, InvalidInput):
        where, path_params = _where(context)
        field = list(exc.loc) if exc.loc is not None else exc.field.split(".")
        if field and field[0] in path_params:
            where = "path"
        item = {"loc": [where, *field], "msg": exc.message, "type": "value_error"}
        return Response({"detail": [item]}, status=422)
    return Response({"detail": str(exc)}, status=400)


def _bad_text_in_body(context: dict[str, Any]) -> tuple[tuple, str] | None:
    request = context.get("request")
    try:
        data = request.data if request is not None else None
    except Exception:  # noqa: BLE001 - the body was unreadable; nothing to name
        return None
    return find_bad_text(data)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, StoreError):
        return _store_error(exc, context)
    if isinstance(exc, exceptions.ValidationError):
        where, path_params = _where(context)
        return validation_response(exc.detail, where, path_params)
    if isinstance(exc, RequestDataTooBig):
        return Response({"detail": "request too large"}, status=413)
    if isinstance(exc, SuspiciousOperation):
        return Response({"detail": "bad request"}, status=400)
    if isinstance(exc, DataError | PgDataError | UnicodeEncodeError):
        # Values the database refuses (a NUL character, a lone surrogate, a number out of
        # range): named when the body holds the culprit.
        bad = _bad_text_in_body(context)
        if bad is not None:
            loc, problem = bad
            return Response({"detail": [{"loc": [getattr(context.get("view"),
                                                         "validation_location", "body"), *loc],
                                         "msg": problem, "type": "value_error"}]}, status=422)
        return Response({"detail": "invalid data: the database refused a value"}, status=400)
    if isinstance(exc, OperationalError | InterfaceError):
        log.warning("database unavailable in %s: %s", context.get("view").__class__.__name__,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        return Response({"detail": "the store's database is unavailable; retry"}, status=503,
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, Http404):
        return Response({"detail": "not found"}, status=404)
    response = drf_exception_handler(exc, context)
    if response is None:
        # A bug of ours: logged with its traceback here, never sent to the client.
        log.exception("unhandled error in %s", context.get("view").__class__.__name__)
        return Response({"detail": "internal server error"}, status=500)
    if not (isinstance(response.data, dict) and "detail" in response.data):
        response.data = {"detail": response.data}
    return response
