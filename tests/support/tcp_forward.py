"""A TCP forwarder LISTEN_PORT -> UPSTREAM_PORT on 127.0.0.1; in a test it can also watch HTTP/1.1.

As a process, the chaos test points every role at it as their S3 endpoint and kills it with -9 to
make the bucket unreachable. (Killing moto itself would also wipe its in-memory data, which no real
outage does; here the data stays and only the endpoint disappears.)

    python tests/tcp_forward.py LISTEN_PORT UPSTREAM_PORT

In a test, `Forwarder(upstream_port, watch)` runs in a thread and reads the HTTP/1.1 requests that
pass (no pipelining, which neither botocore nor httpx does): `watch("request", line)` is called
before a request goes upstream, `watch("response", line)` once its final answer came back, before
that goes to the client; `line` is the request line ("PUT /bucket/key HTTP/1.1"). A watch that
returns True cuts the connection right there: that request never reaches the server, or its
answer never reaches the client. The end-of-run test kills the trainer at those moments.
`Forwarder(upstream_port, watch, drop_headers={"if-match"})` also takes the named request headers out before a
request goes upstream: a store that ignores them (conditional writes it does not honour).
"""
from __future__ import annotations

import asyncio
import collections
import socket
import sys
import threading


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(listen: int, upstream: int) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            cw.close()
            return
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw))

    server = await asyncio.start_server(handle, "127.0.0.1", listen, reuse_address=True)
    await server.serve_forever()


# ---- the HTTP-watching forwarder (in-process, for tests) --------------------------------------------


class Cut(Exception):
    """The watch asked to cut this connection."""


async def _head(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str]] | None:
    """One message head (start line + headers) and its headers, lower-cased; None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
    return head, headers


async def _body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict[str, str],
                until_eof: bool) -> None:
    """Copy one message body: by Content-Length, chunked, or (responses without either) to EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            writer.write(size_line)
            n = int(size_line.split(b";")[0].strip() or b"0", 16)
            if n == 0:
                while (trailer := await reader.readline()) not in (b"\r\n", b""):
                    writer.write(trailer)
                writer.write(b"\r\n")
                return
            writer.write(await reader.readexactly(n + 2))
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left:
            chunk = await reader.read(min(left, 1 << 16))
            if not chunk:
                raise ConnectionError("body cut short")
            writer.write(chunk)
            left -= len(chunk)
    elif until_eof:
        while chunk := await reader.read(1 << 16):
            writer.write(chunk)
    await writer.drain()


class Forwarder:
    """127.0.0.1:port -> 127.0.0.1:upstream in a background thread, calling `watch` (see above)."""

    def __init__(self, upstream: int, watch, drop_headers: frozenset[str] | set[str] = frozenset()):
        self.upstream, self.watch, self.drop = upstream, watch, {h.lower() for h in drop_headers}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(60), f"the forwarder to 127.0.0.1:{upstream} did not start listening"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True))
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            cw.close()
            return
        sent: collections.deque[str] = collections.deque()  # request lines waiting for their answer
        tasks = [asyncio.ensure_future(self._requests(cr, uw, sent)), asyncio.ensure_future(self._responses(ur, cw, sent))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            t.cancel()
        uw.close()
        cw.close()

    async def _requests(self, cr, uw, sent) -> None:
        while (got := await _head(cr)) is not None:
            head, headers = got
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            if self.watch("request", line):
                raise Cut(line)
            sent.append(line)
            if self.drop:
                named = ((x, x.split(b":", 1)[0].strip().lower().decode("latin-1")) for x in head.split(b"\r\n"))
                head = b"\r\n".join(x for x, name in named if name not in self.drop)
            uw.write(head)
            await _body(cr, uw, headers, until_eof=False)
        raise ConnectionError("client closed")

    async def _responses(self, ur, cw, sent) -> None:
        while (got := await _head(ur)) is not None:
            head, headers = got
            status = int(head.split(b" ", 2)[1])
            if 100 <= status < 200:  # an interim answer (100 Continue): the final one follows
                cw.write(head)
                continue
            line = sent.popleft() if sent else "?"
            if self.watch("response", line):
                raise Cut(line)
            cw.write(head)
            bodiless = line.startswith("HEAD ") or status in (204, 304)
            await _body(ur, cw, {} if bodiless else headers, until_eof=not bodiless)
        raise ConnectionError("upstream closed")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
