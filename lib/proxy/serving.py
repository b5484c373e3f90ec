"""The proxy's HTTP server: uvicorn, with the limits a server facing strangers needs and uvicorn lacks.

What uvicorn 0.3x-0.5x offers, and why it is not enough here:
  - timeout_keep_alive (5 s) closes a connection idle *after* a response; a new connection that sends
    nothing, or any connection that sends one byte now and then, is never closed.
  - h11_max_incomplete_event_size bounds a request head, but only with the pure-Python h11 parser;
    with httptools (uvicorn[standard], the faster one) a head is unbounded.
  - limit_concurrency answers 503 to *every* request once that many connections are open, idle ones
    included: a thousand idle connections would shut the run out.
  - nothing bounds the time a request body takes to arrive.

So the httptools protocol is subclassed (uvicorn takes a protocol class as `http=`) to add:
  - a head deadline: a request's line and headers must be complete within head_timeout_s of the
    connection opening or of the previous response; otherwise 408 (or a silent close if nothing came);
  - a body deadline: a request body must be complete within body_timeout_s of its headers (408);
  - a head size cap: more than max_head_bytes before the head is complete gets 431 and a close;
  - a connection cap: beyond max_connections a new connection gets 503 and a close, at once.
Deadlines are a number on each connection, checked by one sweep every half second (a timer armed and
cancelled per request cost ~30 us of the event loop's time a request). Who may send a body at all is
the ASGI guard's business (access.py). And the process's file limit is raised to its hard limit (a
container's default soft limit of 1024 is what a thousand connections exhaust).
"""
from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

SWEEP_S = 0.5


@dataclass
class Limits:
    head_timeout_s: float = 10.0
    """a request head must be complete this long after the connection opened or the last response"""
    body_timeout_s: float = 60.0
    """a request body must be complete this long after its head"""
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


def protocol(limits: Limits, on_shutdown: Callable[[], None] = lambda: None) -> type:
    """The httptools protocol class with `limits` (pass it to uvicorn as http=...). on_shutdown(): called when the
    server asks the connections to close (it was told to stop: SIGTERM), before it waits for their requests to end."""

    class GuardedProtocol(HttpToolsProtocol):
        sweeping = False  # one sweep for all connections, started by the first

        def shutdown(self) -> None:
            on_shutdown()  # first: a request that would wait long (a routed one) learns it should end now
            super().shutdown()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_open, self._head_bytes = True, 0
            self._deadline, self._waiting_for = time.monotonic() + limits.head_timeout_s, "head"
            if not GuardedProtocol.sweeping:
                GuardedProtocol.sweeping = True
                self.loop.call_later(SWEEP_S, GuardedProtocol.sweep, self.loop, self.connections)
            if len(self.connections) > limits.max_connections:
                self._refuse(b"503 Service Unavailable", f"over {limits.max_connections} open connections; retry")

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
            self._deadline, self._waiting_for = time.monotonic() + limits.body_timeout_s, "body"
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head_open, self._deadline = True, None  # the app has it all; what comes next is another head

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # a queued request's head is complete already: no deadline
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._deadline, self._waiting_for = time.monotonic() + limits.head_timeout_s, "head"

        @staticmethod
        def sweep(loop, connections) -> None:
            now = time.monotonic()
            for c in [c for c in connections if getattr(c, "_deadline", None) is not None and c._deadline <= now]:
                c._expire()
            loop.call_later(SWEEP_S, GuardedProtocol.sweep, loop, connections)

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self._waiting_for == "body":
                if self.cycle is not None and not self.cycle.response_started:
                    self._refuse(b"408 Request Timeout", f"request body not complete within {limits.body_timeout_s:g} s")
                else:
                    self.transport.close()
            elif self._head_bytes:  # half a request: say why; an idle connection is just closed
                self._refuse(b"408 Request Timeout", f"request head not complete within {limits.head_timeout_s:g} s")
            else:
                self.transport.close()

        def _refuse(self, status: bytes, msg: str) -> None:
            self._deadline = None
            self.transport.write(_raw_answer(status, msg))
            self.transport.close()

    return GuardedProtocol


def serve(app, host: str, port: int, limits: Limits, on_stop: Callable[[], None] = lambda: None) -> None:
    """uvicorn with `limits`; on_stop() once it is told to stop, while it still waits for the requests in progress
    (uvicorn waits for every one of them, however long, before the app's own shutdown runs)."""
    import uvicorn
    soft = raise_file_limit(limits.max_connections + 256)
    if soft < limits.max_connections + 256:  # keep room for the bucket's connections and the journal
        limits.max_connections = max(16, soft - 256)
        print(f"serving: file limit {soft}: at most {limits.max_connections} connections", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level="warning", http=protocol(limits, on_stop))
