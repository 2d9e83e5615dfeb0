"""uvicorn's HTTP protocol (httptools) with each response's head and body sent in one write.

uvicorn writes a response's status line and headers to the socket on `http.response.start`
and its body on `http.response.body`: two writes, two TCP segments and two wake-ups of the
client per response, though the ASGI front (lightning_site/asgi.py) sends both messages one
after the other without waiting. Here the head is held until the next write on the
connection, which then sends both at once; a head nothing follows in the same turn of the
event loop (a HEAD answer, a `100 Continue`, a streamed body) is sent at the end of that
turn (one `call_soon`), so nothing waits and the order of the bytes never changes.
(`strace -c` on a server answering the lean routes: two `write` calls per request before,
one after.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_JOINED_UP_TO = 1 << 16  # bodies larger than this are written after the head, not copied


class HeadWithBody:
    """A transport that holds a response head for the write that follows it."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop, self._held = transport, loop, None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if len(data) <= _JOINED_UP_TO:
                self._transport.write(held + data)
                return
            self._transport.write(held)
        elif data[:5] == b"HTTP/" and data[-4:] == b"\r\n\r\n":
            self._held = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def write_whole(self, data: bytes) -> None:
        """A whole response (head and body in `data`): written at once, after a head still
        held (lightning_site/leanwire.py)."""
        if self._held is not None:
            self.flush()
        self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:  # asked on every response: not through __getattr__
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadWithBody(transport, self.loop))  # type: ignore[arg-type]
