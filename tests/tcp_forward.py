"""A plain TCP forwarder: LISTEN_PORT -> UPSTREAM_PORT on 127.0.0.1.

The chaos test points every role at this process as its S3 endpoint and kills it with -9 to make
the bucket unreachable. (Killing moto itself would also wipe its in-memory data, which no real
outage does; here the data stays and only the endpoint disappears.)

    python tests/tcp_forward.py LISTEN_PORT UPSTREAM_PORT
"""
import asyncio
import sys


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


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
