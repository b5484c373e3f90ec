"""The bucket and proxy clients wait out outages, however long, and say so at a steady cadence; a
mistake no retry can fix (a 4xx) fails at once with a message naming what and where."""
import os
import subprocess
import threading
import time

import httpx
import pytest

import common

import proxy_client
from conftest import PY, ROOT, SUPPORT, free_port, stop, wait_http
from proxyproc import wait_for


@pytest.fixture
def fast_cadence(monkeypatch):
    monkeypatch.setattr(common, "WAIT_LOG_S", 4.0)  # say it every 4 s instead of 30: a short test sees several


def failing_for(said: list[str]) -> list[int]:
    """The seconds each "waiting for ...: failing for Ns" message said so far."""
    return [int(m.split("failing for ")[1].split("s")[0]) for m in list(said) if m.startswith("waiting for ")]


def still_waiting(t, out, said: list[str], n: int, at_least_s: int) -> None:
    """Until the call in `t` has said it is waiting n times, the last after failing for at_least_s seconds or
    more (its retries had every chance to give up by then): it must not have returned meanwhile."""
    def there() -> bool:
        assert t.is_alive(), f"the call ended during the outage: {out}"
        got = failing_for(said)
        return len(got) >= n and got[-1] >= at_least_s
    wait_for(there, 90, every=0.2, msg=f"{n} waiting messages, the last after {at_least_s} s or more")


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_bucket_call_waits_out_an_outage(s3_env, run_name, fast_cadence):
    """The endpoint gone until the call has said three times that it waits, the last after 10 s or more of
    failing (botocore alone gives up after ~1-3 s with 3 attempts, or at once once its retry quota is
    spent): the call waits, says so every 4 s or more, and returns the object."""
    moto_port = int(s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1])
    port = free_port()
    fwd_cmd = [PY, str(SUPPORT / "tcp_forward.py"), str(port), str(moto_port)]
    fwd = subprocess.Popen(fwd_cmd)
    try:
        wait_http(f"http://127.0.0.1:{port}", fwd)
        bucket = common.Bucket(run=run_name, endpoint=f"http://127.0.0.1:{port}", patience_s=None)
        said = []
        bucket.say = said.append
        bucket.put("k", b"still here")
        fwd.kill()
        fwd.wait()
        t0 = time.time()
        t, out = _in_thread(lambda: bucket.get("k"))
        still_waiting(t, out, said, 3, 10)  # still waiting, not failed, long past botocore's own give-up
        down_s = time.time() - t0
        fwd = subprocess.Popen(fwd_cmd)
        t.join(120)
        assert not t.is_alive() and out.get("value", (None,))[0] == b"still here", out
    finally:
        stop(fwd)
    waits = [s for s in said if s.startswith("waiting for the bucket")]
    # at the first failure, then at the first retry 4 s or more after the last word (retries back
    # off to one every ~10 s)
    assert len(waits) >= 3, said
    assert f"get s3://tests/{run_name}/k at http://127.0.0.1:{port}" in waits[0] and "as long as it takes" in waits[0]
    seconds = [int(s.split("failing for ")[1].split("s")[0]) for s in waits]
    assert all(b - a >= 3 for a, b in zip(seconds, seconds[1:])) and seconds[-1] >= 10, seconds
    assert said[-1].endswith(f"answering again after {said[-1].rsplit(' ', 1)[1]}")
    assert time.time() - t0 >= down_s >= 9.5  # (the messages round to whole seconds: "10s" is 9.5 s or more)


def test_bucket_mistake_fails_at_once():
    """No such bucket is a 4xx: waiting cannot fix it."""
    bucket = common.Bucket(bucket="no-such-bucket-anywhere", run="r", patience_s=None)
    t0 = time.time()
    with pytest.raises(common.BucketError, match=r"get s3://no-such-bucket-anywhere/r/k at http://127\.0\.0\.1:\d+ failed.*NoSuchBucket"):
        bucket.get("k")
    assert time.time() - t0 < 10


def test_proxy_call_waits_for_a_proxy_that_comes_later(s3_env, run_name, tmp_path, fast_cadence):
    port = free_port()
    client = proxy_client.ProxyClient(f"http://127.0.0.1:{port}", "tok", patience_s=None)
    said = []
    client.say = said.append
    t, out = _in_thread(lambda: client.get("/v1/stats"))
    still_waiting(t, out, said, 3, 10)  # waited 10 s and more (and said so), did not fail
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_TOKEN": "tok"}
    proxy = subprocess.Popen([PY, str(ROOT / "proxy.py"), "--port", str(port)], env=env,
                             stdout=open(tmp_path / "proxy.log", "w"), stderr=subprocess.STDOUT)
    try:
        t.join(120)
        assert not t.is_alive() and out["value"]["latest_version"] == 0, out
        waits = [s for s in said if s.startswith(f"waiting for the proxy (GET http://127.0.0.1:{port}/v1/stats)")]
        assert len(waits) >= 2 and "ConnectError" in waits[0], said
        assert said[-1].startswith(f"the proxy (GET http://127.0.0.1:{port}/v1/stats): answering again after")
        # a 4xx is an answer, not an outage: at once, with the status and the proxy's words
        with pytest.raises(proxy_client.ProxyError, match=r"POST http://127\.0\.0\.1:\d+/v1/batches/nope/ack -> 404") as e:
            client.post("/v1/batches/nope/ack")
        assert e.value.status == 404 and "no open lease" in e.value.detail
    finally:
        stop(proxy)


def test_a_stopping_role_stops_waiting(fast_cadence):
    client = proxy_client.ProxyClient(f"http://127.0.0.1:{free_port()}", "tok", patience_s=None)
    client.say = lambda msg: None
    stopping = threading.Event()
    client.should_stop = stopping.is_set
    t, out = _in_thread(lambda: client.get("/v1/stats"))
    time.sleep(3)
    assert t.is_alive()
    stopping.set()
    t0 = time.time()
    t.join(10)
    assert time.time() - t0 < 2 and isinstance(out.get("error"), httpx.ConnectError), out
