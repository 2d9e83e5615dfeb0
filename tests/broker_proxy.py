"""A TCP proxy in front of the broker that a test can cut: every process of the test talks to
the broker through it, so cutting it is a broker outage for all of them (connections closed,
new ones refused) without stopping the broker the development machine shares."""

from __future__ import annotations

import socket
import threading


class BrokerProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.target_port = host, target_port
        probe = socket.socket()
        probe.bind((host, 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._dropping = threading.Event()

    def url(self, broker_url: str) -> str:
        """`broker_url` with the proxy's address in place of the broker's."""
        return broker_url.replace(f"{self.host}:{self.target_port}", f"{self.host}:{self.port}")

    def start(self) -> BrokerProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def blackhole(self) -> None:
        """What clients send stops reaching the broker (the connections stay open), as in the
        moment a broker dies with frames in flight; `cut()` ends it."""
        self._dropping.set()

    def cut(self) -> None:
        """The broker goes away: the listener closes (new connections are refused) and every
        connection through the proxy is closed."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, []
        self._dropping.clear()
        if listener is not None:
            listener.close()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection((self.host, self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for src, dst, to_broker in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, to_broker),
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_broker: bool) -> None:
        try:
            while data := src.recv(65536):
                if not (to_broker and self._dropping.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
