"""The proxy's endpoints through a real uvicorn process: contract, bad input, auth."""
import time
import uuid

import httpx
import pytest

import common
from proxyproc import Worker, wait_for


def group(version=0, G=4, worker="w1", gid=None, **over):
    g = {"group_id": gid or uuid.uuid4().hex, "worker_id": worker, "policy_version": version,
         "prompt_ids": [1, 2, 3],
         "completions": [{"token_ids": [5, 6], "logprobs": [-0.5, -1.0], "reward": float(i % 2),
                          "finish_reason": "stop"} for i in range(G)],
         "meta": {"task": "t"}}
    g.update(over)
    return g


def publish(bucket, proxy, version):
    """A real version: adapter files in the bucket, then registered."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        Path(d, "adapter_model.safetensors").write_bytes(b"x" * 100 + bytes([version]))
        Path(d, "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
        common.publish_adapter(bucket, d, version, version, "m")
    r = proxy.http.post("/v1/adapters", json={"version": version, "step": version, "published_at": time.time()})
    assert r.status_code == 200, r.text


def test_submit_lease_ack_and_idempotency(start_proxy):
    p = start_proxy("--group-size", "4")
    g = group()
    assert p.http.post("/v1/groups", json=g).json() == {"status": "accepted", "duplicate": False, "buffer_size": 1}
    assert p.http.post("/v1/groups", json=g).json()["duplicate"] is True  # same group_id: no change
    assert p.stats()["buffer_size"] == 1
    p.http.post("/v1/groups", json=group())
    r = p.http.post("/v1/batches/lease", json={"num_groups": 2}).json()
    assert r["batch_id"] and [x["group_id"] for x in r["groups"]][0] == g["group_id"]  # FIFO
    assert r["groups"][0]["completions"][1]["logprobs"] == [-0.5, -1.0]
    assert p.stats()["open_leases"] == 1
    assert p.http.post(f"/v1/batches/{r['batch_id']}/ack").json() == {"acked": 2}
    # acking twice, or a batch that never existed: clear 4xx
    again = p.http.post(f"/v1/batches/{r['batch_id']}/ack")
    assert again.status_code == 409 and "already acked" in again.text
    assert p.http.post("/v1/batches/nope/ack").status_code == 404
    s = p.stats()
    assert (s["groups_accepted"], s["groups_duplicate"], s["groups_acked"], s["buffer_size"]) == (2, 1, 2, 0)


def test_lease_waits_then_returns_empty_and_expired_lease_returns_groups(start_proxy):
    p = start_proxy("--group-size", "4", "--lease-s", "1")
    t0 = time.time()
    r = p.http.post("/v1/batches/lease", json={"num_groups": 1, "wait_s": 0.5}).json()
    assert r["batch_id"] is None and r["groups"] == [] and time.time() - t0 >= 0.45 and r["waited_s"] >= 0.45
    p.http.post("/v1/groups", json=group())
    asked = time.monotonic()  # the proxy's lease starts after this (the same monotonic clock: one host)
    r = p.http.post("/v1/batches/lease", json={"num_groups": 1, "wait_s": 5}).json()
    bid = r["batch_id"]
    assert bid and r["waited_s"] < 0.2  # the group was there: no wait (its journal write is not counted)
    wait_for(lambda: p.stats()["leases_expired"] == 1, 60, msg="the 1 s lease to run out")  # housekeeping: every 1 s
    # coarse (the sweep runs once a second); test_lease_renew_ack_and_expiry pins lease_s against a control
    assert time.monotonic() - asked >= 1.0, "the lease ran out before lease_s"
    s = p.stats()
    assert (s["buffer_size"], s["open_leases"]) == (1, 0)
    gone = p.http.post(f"/v1/batches/{bid}/ack")
    assert gone.status_code == 410 and "expired" in gone.text


def test_staleness_filter_and_versions(bucket, start_proxy):
    p = start_proxy("--group-size", "4", "--max-staleness", "1")
    p.http.post("/v1/groups", json=group(version=0))
    publish(bucket, p, 1)
    p.http.post("/v1/groups", json=group(version=1))
    publish(bucket, p, 2)  # the version-0 group is now 2 behind: dropped and counted
    s = p.stats()
    assert s["latest_version"] == 2 and s["buffer_size"] == 1 and s["groups_dropped_stale"] == 1
    r = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()
    assert r["groups"][0]["policy_version"] == 1
    # a group already too stale on arrival is not buffered, and says so
    assert p.http.post("/v1/groups", json=group(version=0)).json()["status"] == "stale"
    # versions are monotonic; an unpublished one is refused
    dup = p.http.post("/v1/adapters", json={"version": 2, "step": 9, "published_at": time.time()})
    assert dup.status_code == 409
    missing = p.http.post("/v1/adapters", json={"version": 5, "step": 9, "published_at": time.time()})
    assert missing.status_code == 422 and "meta.json" in missing.text


def test_latest_long_poll(bucket, start_proxy):
    p = start_proxy("--group-size", "4")
    t0 = time.time()
    r = p.http.get("/v1/adapters/latest", params={"after": 0, "wait_s": 0.6}).json()
    assert r["version"] == 0 and time.time() - t0 >= 0.55
    assert p.http.get("/v1/adapters/latest", params={"after": -1, "wait_s": 5}).json()["version"] == 0  # no wait
    later = Worker(lambda: (time.sleep(0.5), publish(bucket, p, 1)))  # its failure fails the test (at join)
    later.start()
    t0 = time.time()
    r = p.http.get("/v1/adapters/latest", params={"after": 0, "wait_s": 60}).json()
    later.join(60)
    assert r["version"] == 1 and time.time() - t0 < 30  # woke up on the registration, not the 60 s timeout


def test_prompt_lease_covers_each_epoch_without_repeats(start_proxy):
    p = start_proxy("--group-size", "4")
    got = []
    for _ in range(5):
        r = p.http.post("/v1/prompts/lease", json={"dataset": "d", "size": 10, "n": 4}).json()
        got += list(zip(r["epochs"], r["indices"]))
    ep0 = [i for e, i in got if e == 0]
    assert sorted(ep0) == list(range(10))            # epoch 0: every index exactly once
    assert len([i for e, i in got if e == 1]) == 10   # then a new shuffle
    bad = p.http.post("/v1/prompts/lease", json={"dataset": "d", "size": 11, "n": 1})
    assert bad.status_code == 409


def test_backpressure_429_with_retry_after(start_proxy):
    p = start_proxy("--group-size", "4", "--max-buffer", "2")
    for _ in range(2):
        p.http.post("/v1/groups", json=group())
    r = p.http.post("/v1/groups", json=group())
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert p.stats()["buffer_size"] == 2 and p.stats()["groups_rejected_full"] == 1


def test_auth(start_proxy):
    p = start_proxy("--group-size", "4")
    assert httpx.get(f"{p.url}/health").status_code == 200  # no token needed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Proxy-Token": "wrong"}, {"Authorization": p.token}):
        for method, path in [("GET", "/v1/stats"), ("POST", "/v1/groups"), ("POST", "/v1/batches/lease"),
                             ("GET", "/v1/adapters/latest"), ("POST", "/v1/prompts/lease"), ("POST", "/v1/adapters")]:
            r = httpx.request(method, f"{p.url}{path}", headers=headers, json={})
            assert r.status_code == 401, (headers, path, r.status_code)
    # the proxy token in X-Proxy-Token while Authorization carries something else (HF gateway)
    ok = httpx.get(f"{p.url}/v1/stats", headers={"X-Proxy-Token": p.token, "Authorization": "Bearer hf_x"})
    assert ok.status_code == 200


BAD = [  # (what, body, expected status, text the answer must contain)
    ("not json", b"{", 422, "json"),
    ("empty object", {}, 422, "group_id"),
    ("wrong type", group(policy_version="one"), 422, "policy_version"),
    ("negative version", group(version=-1), 422, "policy_version"),
    ("version from the future", group(version=7), 409, "newer than the latest"),
    ("wrong G", group(G=3), 422, "group_size"),
    ("mismatched lengths", group(completions=[{"token_ids": [1, 2], "logprobs": [-1.0], "reward": 0.0,
                                               "finish_reason": "stop"}] * 4), 422, "logprobs"),
    ("NaN logprob", None, 422, "logprobs"),
    ("Infinity reward", None, 422, "reward"),
    ("positive logprob", group(completions=[{"token_ids": [1], "logprobs": [0.5], "reward": 0.0,
                                             "finish_reason": "stop"}] * 4), 422, "logprobs"),
    ("negative token id", group(prompt_ids=[1, -2]), 422, '"prompt_ids",1'),
    ("version sent as a string", group(policy_version="0"), 422, "policy_version"),  # strict: no coercion
    ("token id sent as a float", group(prompt_ids=[1.0, 2]), 422, '"prompt_ids",0'),
    ("unknown field", group(extra=1), 422, "extra"),
    ("bad finish_reason", group(completions=[{"token_ids": [1], "logprobs": [-1.0], "reward": 0.0,
                                              "finish_reason": "eos"}] * 4), 422, "finish_reason"),
    ("empty prompt", group(prompt_ids=[]), 422, "prompt_ids"),
    ("bad group id", group(gid="../../etc"), 422, "group_id"),
    ("huge prompt", group(prompt_ids=[1] * 5000), 422, "max_prompt_tokens"),
]


@pytest.fixture(scope="module")
def shared_proxy(s3_env, tmp_path_factory):
    """One proxy for all the bad-input cases (each checks that /v1/stats did not move)."""
    import os
    import secrets
    import subprocess
    import sys

    from conftest import ROOT, ProxyProc, free_port, stop, wait_http
    from proxyproc import SKEWED
    port, token = free_port(), secrets.token_urlsafe(16)
    log = open(tmp_path_factory.mktemp("proxy") / "proxy.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "proxy.py"), "--port", str(port), "--group-size", "4",
                             "--no-use-bucket"], env={**os.environ, "PROXY_TOKEN": token}, stdout=log, stderr=log)
    wait_http(f"http://127.0.0.1:{port}/health", proc)
    p = ProxyProc(f"http://127.0.0.1:{port}", token, proc)
    p.http.post("/v1/groups", json=group())
    yield p
    stop(proc)


@pytest.mark.parametrize("what,body,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_groups_get_4xx_and_change_nothing(shared_proxy, what, body, status, needle):
    p = shared_proxy
    before = p.stats()
    if what == "NaN logprob":
        raw = '{"group_id":"%s","worker_id":"w","policy_version":0,"prompt_ids":[1],"completions":[%s],"meta":{}}'
        body = (raw % (uuid.uuid4().hex, ",".join(['{"token_ids":[1],"logprobs":[NaN],"reward":0,"finish_reason":"stop"}'] * 4))).encode()
    if what == "Infinity reward":
        raw = '{"group_id":"%s","worker_id":"w","policy_version":0,"prompt_ids":[1],"completions":[%s],"meta":{}}'
        body = (raw % (uuid.uuid4().hex, ",".join(['{"token_ids":[1],"logprobs":[-1],"reward":Infinity,"finish_reason":"stop"}'] * 4))).encode()
    if isinstance(body, bytes):
        r = p.http.post("/v1/groups", content=body, headers={"Content-Type": "application/json"})
    else:
        r = p.http.post("/v1/groups", json=body)
    assert r.status_code == status, r.text
    assert needle.lower() in r.text.lower(), r.text
    after = p.stats()
    for k in ("buffer_size", "groups_accepted", "groups_duplicate", "groups_dropped_stale", "latest_version"):
        assert after[k] == before[k], k


def test_bad_requests_elsewhere(start_proxy):
    p = start_proxy("--group-size", "4", "--max-body-mb", "1", use_bucket=False)
    before = p.stats()
    assert p.http.post("/v1/groups", content=b"x" * (2 << 20)).status_code == 413
    assert p.http.post("/v1/batches/lease", json={"num_groups": 0}).status_code == 422
    assert p.http.post("/v1/batches/lease", json={"num_groups": 1, "wait_s": 1e9}).status_code == 422
    assert p.http.post("/v1/batches/lease", json={"num_groups": "a lot"}).status_code == 422
    assert p.http.get("/v1/adapters/latest", params={"wait_s": -1}).status_code == 422
    assert p.http.post("/v1/adapters", json={"version": 0, "step": 0, "published_at": 1}).status_code == 422
    assert p.http.post("/v1/adapters", json={"version": 1, "step": 0}).status_code == 422
    assert p.http.post("/v1/prompts/lease", json={"dataset": "d", "size": -5, "n": 1}).status_code == 422
    after = p.stats()
    for st in (before, after):   # what moves with the clock alone: peak RSS, the proxy's age
        del st["peak_rss_mb"], st["fleet"]["clock_s"]
    assert after == before


# ---- lease clocks: durations on the proxy's monotonic clock, renewable; versions' age on that clock ----
def test_lease_renew_ack_and_expiry(start_proxy):
    """Two leases taken together; `held` is renewed every 0.3 s, `other` never. Once `other` has run out,
    the sweep that expired it found `held` past its first deadline too (it was taken first): only the
    renewals kept it open. The ack path does not look at deadlines, so without that proof a late sweep
    would let a test of renewals pass with renewals broken."""
    lease_s = 3.0  # the renewals' slack (2.7 s) is large against a loaded machine's jitter
    p = start_proxy("--group-size", "4", "--lease-s", str(lease_s))
    for _ in range(2):
        p.http.post("/v1/groups", json=group())
    last_sent = time.monotonic()  # `held` runs to lease_s after this at least
    r = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()
    assert r["expires_in_s"] == lease_s
    other_asked = time.monotonic()
    other = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()["batch_id"]

    def call(what: str) -> httpx.Response:
        """ack or renew `held`; if it was the lease's end that answered (410), the test's own requests must
        have been more than lease_s apart (the machine stalled): then this run cannot tell, and says so."""
        nonlocal last_sent
        sent = time.monotonic()
        answer = p.http.post(f"/v1/batches/{r['batch_id']}/{what}")
        if answer.status_code == 410 and (gap := time.monotonic() - last_sent) >= lease_s:
            pytest.skip(f"{gap:.1f} s between two renewals of a {lease_s:g} s lease (a stalled machine): not a test")
        last_sent = sent
        return answer

    t0 = time.monotonic()
    while p.stats()["leases_expired"] == 0:  # `other` has not run out yet
        assert time.monotonic() - t0 < 60, "the unrenewed lease never ran out"
        renewed = call("renew")
        assert renewed.status_code == 200 and renewed.json() == {"batch_id": r["batch_id"], "expires_in_s": lease_s}
        time.sleep(0.3)
    assert time.monotonic() - other_asked >= lease_s  # so `held` was kept past lease_s by renewing
    gone = p.http.post(f"/v1/batches/{other}/renew")
    assert gone.status_code == 410 and "expired" in gone.text
    s = p.stats()
    assert (s["open_leases"], s["leases_expired"], s["buffer_size"]) == (1, 1, 1)
    assert call("ack").json() == {"acked": 1}
    assert p.http.post(f"/v1/batches/{r['batch_id']}/renew").status_code == 409
    assert p.http.post("/v1/batches/0123456789abcdef/renew").status_code == 404


def test_a_replayed_lease_gets_a_fresh_lease_s_whatever_the_new_hosts_clock(bucket, run_name, tmp_path):
    """kill -9 with a lease open, and start again on a host whose clock is an hour ahead (time.time shifted
    in the proxy process): the lease is still open, for lease_s from the replay, and its ack succeeds."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT, ProxyProc, free_port, stop, wait_http
    from proxyproc import SKEWED
    port, token = free_port(), "t" * 24
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_TOKEN": token}

    def start(*pre, lease_s="60"):
        log = open(tmp_path / f"proxy-{len(list(tmp_path.iterdir()))}.log", "w")
        proc = subprocess.Popen([sys.executable, *pre, str(ROOT / "proxy.py"), "--port", str(port), "--group-size", "4",
                                 "--lease-s", lease_s], env=env, stdout=log, stderr=log)
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=60)
        return ProxyProc(f"http://127.0.0.1:{port}", token, proc)

    p = start()
    p.http.post("/v1/groups", json=group())
    bid = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()["batch_id"]
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()
    # the new process leases for 1 s; the replayed lease keeps the 60 s its record says
    q = start("-c", SKEWED, "3600", lease_s="1")
    try:
        # a control: a 1 s lease taken after the restart, never renewed. Once it has run out, an expiry sweep
        # ran after every deadline the replayed lease could have got from the hour-ahead clock (all in the
        # past at the replay): the ack path does not look at deadlines, so only this shows that none expired it
        q.http.post("/v1/groups", json=group())
        control = q.http.post("/v1/batches/lease", json={"num_groups": 1}).json()["batch_id"]
        wait_for(lambda: q.stats()["leases_expired"] >= 1, 60, msg="the control lease to run out")
        gone = q.http.post(f"/v1/batches/{control}/ack")
        assert gone.status_code == 410 and "expired" in gone.text
        s = q.stats()
        assert (s["open_leases"], s["leases_expired"], s["buffer_size"]) == (1, 1, 1)
        assert q.http.post(f"/v1/batches/{bid}/ack").json() == {"acked": 1}
    finally:
        stop(q.proc)


def test_latest_says_how_long_ago_this_proxy_registered_it(bucket, run_name, tmp_path, start_proxy):
    p = start_proxy("--group-size", "4")
    assert p.http.get("/v1/adapters/latest").json()["age_s"] is None  # version 0: never registered
    publish(bucket, p, 1)
    a = p.http.get("/v1/adapters/latest").json()["age_s"]
    time.sleep(1.0)
    b = p.http.get("/v1/adapters/latest").json()["age_s"]
    assert 0 <= a < 30 and b - a >= 0.9


def test_prompt_shuffle_covers_every_epoch_for_many_sizes(start_proxy):
    p = start_proxy("--group-size", "4", use_bucket=False)
    for size in (1, 2, 3, 7, 64, 1000):
        got = []
        while len(got) < 2 * size:  # bounded: each answer carries its 5 indices
            r = p.http.post("/v1/prompts/lease", json={"dataset": f"d{size}", "size": size, "n": 5}).json()
            assert len(r["indices"]) == len(r["epochs"]) == 5, r
            got += list(zip(r["epochs"], r["indices"]))
        for epoch in (0, 1):
            assert sorted(i for e, i in got if e == epoch) == list(range(size)), size
        if size >= 64:  # shuffled, and differently in each epoch
            first = [i for e, i in got if e == 0]
            assert first != sorted(first) and first != [i for e, i in got if e == 1]
