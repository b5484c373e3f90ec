"""An HTTP forwarder in front of the S3 server that loses answers: each request is passed upstream and
done there, but the answer to the first COUNT PUT requests whose path contains SUBSTRING never comes
back (the client's connection is closed instead). That is what a network blip between a client and S3
looks like: the write happened, its answer did not arrive, and the client retries.

    python tests/lossy_forward.py LISTEN_PORT UPSTREAM_PORT SUBSTRING COUNT [stall [SKIP]]

With `stall`, the first COUNT such PUTs after SKIP of them are stalled instead: half of the body goes
upstream, then nothing more either way until this process is killed (an upload cut short: S3 stores
nothing). A client killed meanwhile was killed in the middle of that write.

One request per client connection (the S3 server closes after every answer anyway); bodies must carry
Content-Length (botocore's PUTs do). Every lost answer is reported on stderr.
"""
import asyncio
import sys


async def main(listen: int, upstream: int, substring: bytes, count: int, stall: bool = False, skip: int = 0) -> None:
    left, skipped = [count], [skip]

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            head = await cr.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
                assert name.strip().lower() != b"transfer-encoding", "chunked bodies are not supported"
            body = await cr.readexactly(length)
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
            method, path = head.split(b" ", 2)[:2]
            if stall and method == b"PUT" and substring in path and left[0] > 0:
                if skipped[0] > 0:
                    skipped[0] -= 1
                else:
                    left[0] -= 1
                    uw.write(head + body[:length // 2])
                    await uw.drain()
                    print(f"stalled PUT {path.decode()}", file=sys.stderr, flush=True)
                    await asyncio.Event().wait()  # until killed
            uw.write(head + body)
            await uw.drain()
            answer = await ur.read()  # the S3 server closes the connection after its answer
            uw.close()
            if not stall and method == b"PUT" and substring in path and left[0] > 0:
                left[0] -= 1
                print(f"lost the answer to PUT {path.decode()}", file=sys.stderr, flush=True)
            else:
                cw.write(answer)
                await cw.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            cw.close()

    server = await asyncio.start_server(handle, "127.0.0.1", listen, reuse_address=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].encode(), int(sys.argv[4]),
                     sys.argv[5:6] == ["stall"], int((sys.argv[6:7] or ["0"])[0])))
