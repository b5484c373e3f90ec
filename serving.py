"""The proxy's HTTP server: uvicorn, with the limits a server facing strangers needs and uvicorn lacks.

What uvicorn 0.3x-0.5x offers, and why it is not enough here:
  - timeout_keep_alive (5 s) closes a connection idle *after* a response; a new connection that sends
    nothing, or any connection that sends one byte now and then, is never closed.
  - h11_max_incomplete_event_size bounds a request head, but only with the pure-Python h11 parser;
    with httptools (uvicorn[standard], several times cheaper per request) a head is unbounded.
  - limit_concurrency answers 503 to *every* request once that many connections are open, idle ones
    included: a thousand idle connections would shut the run out.

So the httptools protocol is subclassed (uvicorn takes a protocol class as `http=`) to add:
  - a head deadline: a request head (request line + headers) must be complete within head_timeout_s of
    the connection opening or of the previous response; otherwise 408 (or a silent close if nothing came);
  - a head size cap: more than max_head_bytes before the head is complete gets 431 and a close;
  - a connection cap: beyond max_connections a new connection gets 503 and a close, at once.
Bodies are the ASGI guard's business (access.py: no body is read before the token is checked, and
each has a size cap and a deadline). And the process's file limit is raised to its hard limit (a
container's default soft limit of 1024 is what a thousand connections exhaust).
"""
from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass
class Limits:
    head_timeout_s: float = 10.0
    """a request head must be complete this long after the connection opened or the last response"""
    max_head_bytes: int = 64 << 10
    """request line + headers"""
    max_connections: int = 4096
    """open connections; more are refused with 503"""


def raise_file_limit(want: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; returns the soft limit now in force (it may
    stay below `want` if the hard limit is lower: the caller then allows fewer connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, want)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            print(f"serving: could not raise the file limit from {soft} to {target}: {e}", file=sys.stderr)
    return soft


def _raw_answer(status: bytes, msg: str) -> bytes:
    body = msg.encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def protocol(limits: Limits) -> type:
    """The httptools protocol class with `limits` (pass it to uvicorn as http=...)."""

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_open, self._head_bytes, self._deadline = True, 0, None
            if len(self.connections) > limits.max_connections:
                self._refuse(b"503 Service Unavailable", f"over {limits.max_connections} open connections; retry")
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_open:
                self._head_bytes += len(data)
            super().data_received(data)
            # checked after parsing: a chunk that ends the head and starts a big body is not a big head
            if self._head_open and self._head_bytes > limits.max_head_bytes and not self.transport.is_closing():
                self._refuse(b"431 Request Header Fields Too Large",
                             f"request line and headers over {limits.max_head_bytes} bytes")

        def on_headers_complete(self) -> None:
            self._head_open, self._head_bytes = False, 0
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head_open = True  # what comes next on this connection is the next request's head

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # a queued request's head is complete already: no deadline
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.head_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _head_timeout(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self._head_bytes:  # half a request: say why; an idle connection is just closed
                self._refuse(b"408 Request Timeout", f"request head not complete within {limits.head_timeout_s:g} s")
            else:
                self.transport.close()

        def _refuse(self, status: bytes, msg: str) -> None:
            self._disarm()
            self.transport.write(_raw_answer(status, msg))
            self.transport.close()

    return GuardedProtocol


def serve(app, host: str, port: int, limits: Limits) -> None:
    import uvicorn
    soft = raise_file_limit(limits.max_connections + 256)
    if soft < limits.max_connections + 256:  # keep room for the bucket's connections and the journal
        limits.max_connections = max(16, soft - 256)
        print(f"serving: file limit {soft}: at most {limits.max_connections} connections", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level="warning", http=protocol(limits))
