"""The proxy client every role uses (rollout.py, train.py, evaluate.py, the launcher's token commands),
the record in the run's prefix that says where the proxy answers now, and adapter downloads for a
worker without bucket keys (the URLs the proxy hands out, each file checked against meta.json).

A call waits out an unreachable proxy or a 5xx for as long as its patience says (common.patiently),
honours 429 + Retry-After (backpressure, counted), and raises ProxyError at once on any other 4xx (TokenRefused
where the token itself is refused: revoked or quarantined).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from common import PROTOCOL, AdapterError, Bucket, KnownFiles, ProtocolError, check_meta, check_protocol, log, patiently

# On Hugging Face Jobs a relaunched proxy is a new job with a new URL, so its address lives in the
# run's prefix, not in anyone's environment: whoever can see the proxy's public URL and has seen it
# answer /health (the launcher, the supervisor: they read `job.status.expose_urls`) writes
# `proxy/endpoint.json`; workers and the trainer read it when PROXY_URL is unset, and again
# whenever the URL they use stops answering.

PROXY_ENDPOINT = "proxy/endpoint.json"  # {url, incarnation, job_id, written_at, written_by}
# A job cannot see its own exposed URL; with a standby the proxy that takes the lead must write the record itself, so
# whoever sees a proxy job's URL (launcher, supervisor) leaves it for that job here: {url, written_by}
JOB_URL = "proxy/urls/{job_id}.json"


def write_proxy_endpoint(bucket: Bucket, url: str, job_id: str | None = None, incarnation: int | None = None,
                         written_by: str = "") -> dict:
    """Record where the run's proxy answers now (last writer wins: it has just seen that proxy healthy)."""
    record = {"url": url.rstrip("/"), "incarnation": incarnation, "job_id": job_id, "written_at": time.time(),
              "written_by": written_by}
    bucket.put_json(PROXY_ENDPOINT, record)
    return record


def write_job_url(bucket: Bucket, job_id: str, url: str, written_by: str) -> None:
    """Tell the proxy job `job_id` the URL its clients reach it at (it reads it when it takes the lead)."""
    bucket.put_json(JOB_URL.format(job_id=job_id), {"url": url.rstrip("/"), "written_by": written_by})


def read_job_url(bucket: Bucket, job_id: str) -> str | None:
    """The URL the launcher or supervisor left for this proxy job, or None (not seen running yet)."""
    record = bucket.get_json(JOB_URL.format(job_id=job_id))
    return record["url"] if isinstance(record, dict) and isinstance(record.get("url"), str) else None


def read_proxy_endpoint(bucket: Bucket) -> dict | None:
    """The run's proxy address record, or None when nobody wrote one (a local run: PROXY_URL is set)."""
    record = bucket.get_json(PROXY_ENDPOINT)
    return record if isinstance(record, dict) and isinstance(record.get("url"), str) else None


def endpoint_resolver(bucket: Bucket | None = None) -> Callable[[], str | None]:
    """A `ProxyClient(resolve=...)` that reads the run's record (the run from the environment by default)."""
    held: list[Bucket] = [bucket] if bucket is not None else []

    def resolve() -> str | None:
        if not held:
            held.append(Bucket())
        record = read_proxy_endpoint(held[0])
        return record["url"] if record else None
    return resolve


def default_resolver() -> Callable[[], str | None] | None:
    """PROXY_URL set: it overrides, no lookups. Unset, with a run in the environment (BUCKET): the record."""
    if os.environ.get("PROXY_URL") or not os.environ.get("BUCKET"):
        return None
    return endpoint_resolver()



class ProxyError(RuntimeError):
    """The proxy answered 4xx: our request was wrong, or the state it names (acked, expired, not
    newer) is final; retrying will not help. `status` and `detail` say which."""

    def __init__(self, method: str, url: str, status: int, text: str):
        super().__init__(f"{method} {url} -> {status}: {text[:500]}")
        self.status = status
        try:
            self.detail = str(json.loads(text).get("detail", ""))
        except (ValueError, AttributeError):
            self.detail = text[:500]


class TokenRefused(ProxyError):
    """The proxy refuses this client's token on every route: revoked, or its participant quarantined (the answer's
    X-Token-Refused header; `detail` says why and who can lift it). No request will succeed until the run's owner
    acts: a role stops, saying `detail`, rather than retrying or setting its work aside as refused."""


class ProxyBusy(httpx.HTTPError):
    """Still 429 when the caller asked to stop waiting (not retried: the spool keeps the group)."""


def _retryable(e: BaseException) -> bool:
    if isinstance(e, httpx.TransportError):
        return True
    return isinstance(e, httpx.HTTPStatusError) and e.response.status_code >= 500


class ProxyClient:
    """Talks to proxy.py. The proxy token goes in `X-Proxy-Token`; `Authorization` carries the HF
    token when the proxy sits behind the HF Jobs `--expose` gateway, else the proxy token too.

    A call waits out an unreachable proxy or a 5xx for `patience_s` (None: as long as it takes,
    saying so every 30 s), or until `should_stop()`; then it raises the last httpx error. A 429
    waits as long as Retry-After says, counted in `backpressure_s`. A 4xx raises ProxyError at once.

    `resolve` returns the proxy's current URL (default: the run's `proxy/endpoint.json` when PROXY_URL
    is unset, see `default_resolver`). It is asked once here, then before every retry and whenever
    what answers is not the run's proxy any more (`refresh_url`), so a proxy relaunched at a new
    address is found again."""

    def __init__(self, url: str, token: str | None, hf_token: str | None = None, patience_s: float | None = None,
                 resolve: Callable[[], str | None] | None = None):
        headers = {"X-Protocol": str(PROTOCOL)}  # the proxy refuses another protocol, naming both (access.guard)
        if token:
            headers["X-Proxy-Token"] = token
        auth = hf_token or token
        if auth:
            headers["Authorization"] = f"Bearer {auth}"
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(10, read=120))
        self.patience_s = patience_s
        self.backpressure_s = 0.0  # total time spent waiting on 429 answers (wall time: calls from several
        self._waits_until = 0.0    # threads that wait at once count once; see _count_wait)
        self._waits_lock = threading.Lock()
        self.should_stop = lambda: False  # a stopping role gives up waiting (outage or 429)
        self.say = log
        self.resolve = resolve if resolve is not None else default_resolver()
        self.refresh_url()  # the run's record, when there is one, wins over the built-in default URL

    def check_protocol(self) -> dict:
        """Every role's first call: GET /v1/whoami, which says who this token is and the proxy's protocol. Exits
        (SystemExit, naming both protocols) when the proxy speaks another than this code (common.PROTOCOL), so that
        a clone older or newer than the run's proxy stops at its start with a message, not in the middle of a run.
        Returns the answer."""
        try:
            who = self.get("/v1/whoami")
            check_protocol(who.get("protocol"), f"the proxy at {self.url}",
                           "run the code the run was started with (git pull, or check out the run owner's commit)")
        except ProxyError as e:
            if e.status == 426:  # it refused ours (an X-Protocol it does not speak): its message names both
                raise SystemExit(f"the proxy at {self.url} refused this client: {e.detail}") from None
            raise
        except ProtocolError as e:
            raise SystemExit(str(e)) from None
        return who

    @property
    def url(self) -> str:
        """Where requests go now: the HTTP client's base URL is the one record of it."""
        return str(self.http.base_url).rstrip("/")

    def with_patience(self, patience_s: float | None) -> "ProxyClient":
        """The same client (connections, token, should_stop, URL lookups) with another patience."""
        other = copy.copy(self)
        other.patience_s = patience_s
        return other

    def refresh_url(self) -> bool:
        """Ask `resolve` where the proxy is now; switch to that URL if it moved. True if it did."""
        if self.resolve is None:
            return False
        try:
            url = self.resolve()
        except Exception as e:  # noqa: BLE001 - the bucket is down too: keep the URL we have, the caller retries
            self.say(f"proxy address lookup failed ({type(e).__name__}: {e}); keeping {self.url}")
            return False
        if not url or url.rstrip("/") == self.url:
            return False
        self.say(f"proxy: now at {url} (was {self.url})")
        self.http.base_url = url.rstrip("/")
        return True

    def _call(self, method: str, path: str, **kw) -> Any:
        tries = [0]

        def attempt() -> Any:
            if tries[0]:  # a retry: the proxy may have been relaunched at a new address
                self.refresh_url()
            tries[0] += 1
            return self._once(method, path, **kw)
        return patiently(attempt, f"the proxy ({method} {self.url}{path})", _retryable, self.patience_s, self.say,
                         lambda: self.should_stop())

    def _once(self, method: str, path: str, **kw) -> Any:
        while True:
            r = self.http.request(method, path, **kw)
            if r.status_code in (401, 403, 404) and self.refresh_url():
                continue  # what answered was not the run's proxy any more (a gateway, another server)
            if r.status_code != 429:
                break
            # backpressure: the proxy's buffer is full; wait as told and count the time
            if self.should_stop():
                raise ProxyBusy(f"{method} {path}: buffer full and we are stopping")
            wait = float(r.headers.get("Retry-After", "1"))
            self._count_wait(wait)
            time.sleep(wait)
        if 400 <= r.status_code < 500:
            refused = TokenRefused if r.headers.get("x-token-refused") else ProxyError
            raise refused(method, f"{self.url}{path}", r.status_code, r.text)
        if r.status_code >= 500:  # with the proxy's words (a 503 says when its bucket is down)
            raise httpx.HTTPStatusError(f"{r.status_code}: {r.text[:300]}", request=r.request, response=r)
        return r.json()

    def _count_wait(self, wait: float) -> None:
        """Adds a 429's wait to `backpressure_s`, less what overlaps waits already counted (a worker sends a
        round's groups from several threads at once: eight of them refused together wait one second, not eight)."""
        with self._waits_lock:
            now = time.monotonic()
            self.backpressure_s += max(0.0, now + wait - max(now, self._waits_until))
            self._waits_until = max(self._waits_until, now + wait)

    def get(self, path: str, **params) -> Any:
        return self._call("GET", path, params=params)

    def post(self, path: str, body: Any = None) -> Any:
        return self._call("POST", path, json=body)


# ---------------------------------------------------------------------------------------------
# adapters for a worker without bucket keys: through the URLs the proxy hands out


def fetch_adapter_via_proxy(client: ProxyClient, version: int, dest: str | Path,
                            known: KnownFiles | None = None) -> dict:
    """fetch_adapter for a worker without bucket keys: the files come through the URLs the proxy hands
    out (`GET /v1/adapters/{version}/files`: a presigned bucket URL, or the proxy streaming the file;
    see adapter_files.py), and every file is checked against meta.json's sha256 the same way. The listing
    carries meta.json itself (the proxy read and checked it when the version was registered), which saves
    a request; a file `known` already holds under its sha256 is written from there. Files are streamed to
    disk (an adapter can be a GB) and renamed into place only once they verify."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    listing = client.get(f"/v1/adapters/{version}/files")
    files = listing["files"]
    meta = proxy_adapter_meta(client, version, listing)
    for name, want in meta["files"].items():
        part = dest / f".{name}.part"
        if known is not None and (data := known.get(want)) is not None:
            part.write_bytes(data)
            os.replace(part, dest / name)
            continue
        digest = _download(client, files[name], part, f"version {version}: {name}")
        if digest != want:
            part.unlink(missing_ok=True)
            raise AdapterError(f"version {version}: {name} sha256 {digest[:12]}... != meta.json {want[:12]}...")
        if known is not None and part.stat().st_size <= known.MAX_BYTES:
            known.add(want, part.read_bytes())
        os.replace(part, dest / name)
    return meta


def proxy_adapter_meta(client: ProxyClient, version: int, listing: dict | None = None) -> dict:
    """Version `version`'s meta.json from the proxy's listing (or through its URL, from a proxy whose listing
    does not carry it), checked to describe that version's files."""
    listing = listing or client.get(f"/v1/adapters/{version}/files")
    if listing.get("meta") is not None:
        return check_meta(json.dumps(listing["meta"]).encode(), version)
    return check_meta(_download(client, listing["files"]["meta.json"], None, f"version {version}: meta.json"), version)


def _download(client: ProxyClient, entry: dict, path: Path | None, what: str) -> bytes | str:
    """GET entry["url"] (falling back to entry["path"] on the proxy): the bytes (path None), or the sha256 of
    what was written to `path`. The proxy token goes only to the proxy, never to a presigned bucket URL."""
    errors = []
    for url in dict.fromkeys([entry["url"], entry["path"]]):
        on_proxy = url.startswith("/")
        own = None if on_proxy else httpx.Client(timeout=httpx.Timeout(10, read=120), follow_redirects=True)
        try:
            for _ in range(5):  # 503 + Retry-After: the proxy streams a few downloads at a time
                with (client.http if on_proxy else own).stream("GET", url) as r:
                    if r.status_code == 503:
                        time.sleep(float(r.headers.get("Retry-After", "2")))
                        continue
                    r.raise_for_status()
                    if path is None:
                        return r.read()
                    h = hashlib.sha256()
                    with open(path, "wb") as f:
                        for chunk in r.iter_bytes(1 << 20):
                            h.update(chunk)
                            f.write(chunk)
                    return h.hexdigest()
            errors.append(f"{'proxy' if on_proxy else 'presigned URL'}: still busy")
        except httpx.HTTPStatusError as e:
            errors.append(f"{'proxy' if on_proxy else 'presigned URL'}: HTTP {e.response.status_code}")
        except httpx.HTTPError as e:
            errors.append(f"{'proxy' if on_proxy else 'presigned URL'}: {type(e).__name__}")
        finally:
            if own is not None:
                own.close()
    raise AdapterError(f"{what}: download failed ({'; '.join(errors)})")
