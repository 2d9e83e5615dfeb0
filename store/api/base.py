"""The base of every API view: key authentication, roles per HTTP method, JSON only, the
size limit on bodies, and store errors mapped to HTTP statuses."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

from django.core.handlers.wsgi import LimitedStream
from rest_framework import exceptions, serializers
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from store import watchdog
from store.api import limits
from store.api.auth import ApiKeyAuthentication, HasRole, KeyPrincipal
from store.api.errors import PayloadTooLarge, exception_handler
from store.errors import BadQuery
from store.models import Project

CANCELLED_HEADER = "X-Cancelled-Rollouts"


class JSONNullRenderer(JSONRenderer):
    """JSON, with None as `null` (AGL answers `null` for "none"), not an empty body.

    ASCII only (non-ASCII characters escaped): a string a client sent that has no UTF-8 form (a lone
    surrogate), echoed in an error message or a stored value, cannot break the answer."""

    ensure_ascii = True

    def render(self, data: Any, accepted_media_type: str | None = None,
               renderer_context: dict | None = None) -> bytes:
        response = (renderer_context or {}).get("response")
        if data is None:
            return b"" if response is not None and response.status_code == 204 else b"null"
        return super().render(data, accepted_media_type, renderer_context)


class StoreJSONParser(JSONParser):
    """DRF's JSON parser; JSON nested deeper than Python's recursion limit is a 400 with
    AGL 0.3's answer (FastAPI's, for a body its parser raised on), not a RecursionError
    (500)."""

    def parse(self, stream: Any, media_type: str | None = None,
              parser_context: dict | None = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("There was an error parsing the body") from None


class LengthRequired(exceptions.APIException):
    status_code = 411
    default_detail = "a chunked body needs a server that ends it; send Content-Length"
    default_code = "length_required"


def buffer_chunked_body(request: Request) -> None:
    """A body sent chunked (no Content-Length) was never read: Django and DRF take a missing
    length for an empty body, so an OTLP export answered 200 and stored nothing. Under a
    server that ends the stream for us (gunicorn sets `wsgi.input_terminated`), it is read
    here, up to the size limit, and handed on with its length; elsewhere it is a 411."""
    meta = request.META
    if meta.get("CONTENT_LENGTH") or "chunked" not in meta.get(
            "HTTP_TRANSFER_ENCODING", "").lower():
        return
    if not meta.get("wsgi.input_terminated"):
        raise LengthRequired()
    body = meta["wsgi.input"].read(limits.MAX_BODY_BYTES + 1)
    if len(body) > limits.MAX_BODY_BYTES:
        raise PayloadTooLarge(f"request body over {limits.MAX_BODY_BYTES} bytes")
    django_request = request._request
    django_request._stream = LimitedStream(io.BytesIO(body), len(body))
    meta["CONTENT_LENGTH"] = str(len(body))


def check_body_size(request: Request) -> None:
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > limits.MAX_BODY_BYTES:
        raise PayloadTooLarge(f"request body over {limits.MAX_BODY_BYTES} bytes")


class StoreView(APIView):
    """Subclasses define one handler each (`get`, `post`, `delete`) and the key roles allowed
    to call it as `<method>_roles` (default: every role)."""

    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [HasRole]
    renderer_classes = [JSONNullRenderer]
    parser_classes = [StoreJSONParser]
    validation_location = "body"

    def get_exception_handler(self):  # noqa: ANN201 - DRF's hook
        return exception_handler

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        buffer_chunked_body(request)
        check_body_size(request)
        super().initial(request, *args, **kwargs)
        if isinstance(request.user, KeyPrincipal):
            watchdog.sweep_on_call(request.user.project.pk)

    @property
    def project(self) -> Project:
        user = self.request.user
        assert isinstance(user, KeyPrincipal)
        return user.project

    def body(self, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
        """The validated JSON body; an empty body or `null` counts as `{}`."""
        data = self.request.data
        serializer = serializer_class(data={} if data is None else data)
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data

    def refuse_nulls(self, *fields: str) -> None:
        """AGL 0.3's server: an explicit null for a field its store cannot take is a 400
        (an omitted field is left as it is)."""
        data = self.request.data
        if not isinstance(data, dict):
            return
        for name in fields:
            if name in data and data[name] is None:
                raise BadQuery(f"{name} is invalid; it cannot be a null value.")

    def query(self, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
        """The validated query parameters. A blank value is a value (`limit=` is a 422, as in
        AGL 0.3), not an absent parameter; list fields take every repeat of their name."""
        self.validation_location = "query"
        params = self.request.query_params
        fields = serializer_class().fields
        data = {
            name: params.getlist(name) if isinstance(fields.get(name), serializers.ListField)
            else params[name]
            for name in params
        }
        serializer = serializer_class(data=data)
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data


def respond(serializer_class: type[serializers.Serializer], instance: Any, *, status: int = 200,
            many: bool = False, cancelled: Iterable[str] = ()) -> Response:
    if instance is None:
        data = None
    else:
        data = serializer_class(instance, many=many).data
    response = Response(data, status=status)
    ids = sorted(cancelled)
    if ids:
        response[CANCELLED_HEADER] = ",".join(ids)
    return response
