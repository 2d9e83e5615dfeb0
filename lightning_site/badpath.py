"""No URL of this site contains a NUL character, and Postgres refuses one in a query (an admin
page or an API id with `%00` was a DataError, a 500): such a request is a 400 before any
view runs."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse


class RefuseNulPathMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if "\x00" in request.path_info:
            return JsonResponse({"detail": "bad request: a NUL character in the URL"},
                                status=400)
        return self.get_response(request)
