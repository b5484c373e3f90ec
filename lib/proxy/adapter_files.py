"""A published adapter version's files, as the proxy handles them: checking that a version being
registered is complete (check_published), and handing its files to workers without bucket keys.

The proxy answers `GET /v1/adapters/{version}/files` with the version's meta.json itself (`meta`, as read and
checked at registration: a worker need not fetch it) and, for meta.json and each adapter file, a `url` and a
`path`:

  - presigned: `url` is a short-lived presigned GET URL (query-string SigV4) straight to the bucket, so
    the bytes never pass through the proxy. It names the bucket's endpoint and the object's key.
  - proxy: `url` is `path`, `/v1/adapters/{version}/files/{name}` on the proxy, which streams the
    object from the bucket itself (worker token; at most --max-downloads at once, 503 beyond).

`path` is always offered: a worker tries `url` first and falls back to `path` if it fails. The worker
checks every file's sha256 against meta.json either way (proxy_client.fetch_adapter_via_proxy).

Whether a bucket honours presigned URLs is not always documented (the Hugging Face Storage Buckets S3
gateway does not say), so with --adapter-urls auto the proxy finds out at start: it writes a probe
object, fetches it through a presigned URL without credentials, and uses presigned URLs only if the
bytes come back.
"""
from __future__ import annotations

import asyncio
import math
import os
import sys
import time

import boto3
import httpx
from botocore.config import Config
from botocore.exceptions import ClientError
from fastapi import HTTPException
from fastapi.responses import Response

from common import ADAPTER_FILES, AdapterError, Bucket, adapter_prefix, check_meta

FILES = ("meta.json", *ADAPTER_FILES)
PROBE_KEY = "access/presign-probe.bin"
CHUNK = 1 << 20
SIGNED_KEPT = 8  # versions whose signed URLs are kept (workers ask for the newest few)
META_KEPT = 64  # registered versions whose meta.json the listing answers from memory (workers ask for the newest)
SEND_TIMEOUT_S = 60.0  # a client that reads nothing for this long loses its download (and its slot)


def check_published(bucket: Bucket, version: int) -> dict:
    """422 unless version's meta.json passes common.check_meta (the check every reader makes) and the files
    it lists are in the bucket (the trainer writes files, then meta.json, then registers: all must be there).
    Returns the meta."""
    got = bucket.get(f"{adapter_prefix(version)}/meta.json")
    try:
        meta = check_meta(got and got[0], version)
    except AdapterError as e:
        raise HTTPException(422, f"{e}: publish it first" if got is None else str(e)) from None
    present = {k.rsplit("/", 1)[1] for k in bucket.list(f"{adapter_prefix(version)}/")}
    if missing := sorted(set(ADAPTER_FILES) - present):
        raise HTTPException(422, f"version {version}: {missing} missing from the bucket")
    return meta


class Downloads:
    def __init__(self, bucket: Bucket, mode: str, ttl_s: float, max_streams: int):
        self.bucket, self.ttl_s, self.max_streams, self.streams = bucket, ttl_s, max_streams, 0
        self.metas: dict[int, dict] = {}  # version -> its meta.json, as checked at registration
        self.signed: dict[int, tuple[float, dict]] = {}  # version -> (when its URLs were signed, its files)
        # a client of its own: presigned URLs need SigV4 (botocore signs custom endpoints with v2 by
        # default), and a stream held open by a slow reader must not take a connection the journal needs
        cfg = bucket.s3.meta.config.merge(Config(signature_version="s3v4"))
        self.s3 = boto3.client("s3", endpoint_url=bucket.endpoint, config=cfg, region_name=bucket.s3.meta.region_name)
        self.mode = "presigned" if mode == "auto" and self.probe() else ("proxy" if mode == "auto" else mode)
        print(f"adapter files: for workers via {self.mode} URLs", file=sys.stderr, flush=True)

    def presign(self, rel: str, ttl_s: float) -> str:
        return self.s3.generate_presigned_url("get_object", Params={"Bucket": self.bucket.bucket,
                                                                    "Key": self.bucket.key(rel)}, ExpiresIn=int(ttl_s))

    def probe(self) -> bool:
        """Does the bucket serve a presigned GET? (a probe object, fetched without credentials)"""
        data = os.urandom(32).hex().encode()
        try:
            self.bucket.put(PROBE_KEY, data)
            r = httpx.get(self.presign(PROBE_KEY, 60), timeout=15, follow_redirects=True)
            ok = r.status_code == 200 and r.content == data
            why = f"HTTP {r.status_code}" + ("" if r.status_code != 200 or ok else ", other bytes")
        except Exception as e:  # noqa: BLE001 - any failure means: do not hand such URLs out
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            print(f"adapter files: a presigned GET of a probe object failed ({why}); the proxy streams adapter "
                  "files itself", file=sys.stderr, flush=True)
        return ok

    def remember(self, version: int, meta: dict) -> None:
        """A registered version's meta.json, kept for the listing (the newest META_KEPT versions; on the event
        loop's thread only)."""
        self.metas[version] = meta
        while len(self.metas) > META_KEPT:
            self.metas.pop(min(self.metas))

    async def meta(self, version: int) -> dict | None:
        """A registered version's meta.json for the listing: kept since its registration, or (one registered before
        a restart, or older than those kept) read from the bucket, checked again and kept; None if it no longer
        reads or checks (the worker's own download of meta.json then says why)."""
        if (meta := self.metas.get(version)) is None and (meta := await asyncio.to_thread(self.read_meta, version)):
            self.remember(version, meta)
        return meta

    def read_meta(self, version: int) -> dict | None:
        got = self.bucket.get(f"{adapter_prefix(version)}/meta.json")
        try:
            return check_meta(got and got[0], version)
        except AdapterError:
            return None

    def listing(self, version: int, meta: dict | None) -> dict:
        """A version's files for a worker. Its URLs are signed once and handed out again while at least half their
        lifetime is left: every worker asks for the same new version within a second or two, and signing three
        URLs for each of a thousand workers on the event loop would delay everything else it answers."""
        now = time.monotonic()
        made_at, files = self.signed.get(version, (-math.inf, None))
        if now - made_at > self.ttl_s / 2:
            made_at, files = now, {}
            for name in FILES:
                path = f"/v1/adapters/{version}/files/{name}"
                url = self.presign(f"{adapter_prefix(version)}/{name}", self.ttl_s) if self.mode == "presigned" else path
                files[name] = {"url": url, "path": path}
            self.signed[version] = (made_at, files)
            while len(self.signed) > SIGNED_KEPT:
                self.signed.pop(min(self.signed))
        expires_in_s = round(self.ttl_s - (now - made_at), 1) if self.mode == "presigned" else None
        return {"version": version, "via": self.mode, "expires_in_s": expires_in_s, "files": files, "meta": meta}

    async def stream(self, version: int, name: str) -> Response:
        if self.streams >= self.max_streams:
            raise HTTPException(503, f"{self.max_streams} adapter downloads are under way through the proxy; retry",
                                headers={"Retry-After": "2"})
        self.streams += 1
        try:
            obj = await asyncio.to_thread(self.s3.get_object, Bucket=self.bucket.bucket,
                                          Key=self.bucket.key(f"{adapter_prefix(version)}/{name}"))
        except ClientError as e:
            self.streams -= 1
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise HTTPException(404, f"version {version} has no {name} in the bucket") from None
            raise
        except BaseException:
            self.streams -= 1
            raise
        return BucketStream(obj["Body"], obj["ContentLength"], self.release)

    def release(self) -> None:
        self.streams -= 1


class BucketStream(Response):
    """An object's bytes, read from the bucket a chunk at a time (in a thread) and sent as they come."""

    def __init__(self, body, length: int, release):
        super().__init__(media_type="application/octet-stream")
        self.body_stream, self.length, self.release = body, length, release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream"),
                                    (b"content-length", str(self.length).encode())]})
            while chunk := await asyncio.to_thread(self.body_stream.read, CHUNK):
                await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                       SEND_TIMEOUT_S)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.TimeoutError:  # the client stopped reading: uvicorn closes the connection
            pass
        finally:
            self.body_stream.close()
            self.release()
