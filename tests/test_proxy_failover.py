"""A standby proxy (proxy.py --standby) against the real processes and the real S3 server: it follows the journal,
takes the lead when the leader is killed (kill -9) or hung (SIGSTOP), within seconds, with every accepted group
still buffered or acked once and no group in two leases; clients find it through proxy/endpoint.json and retry
what was in flight (routed inference requests: tests/test_routing.py, with a real worker); a leader cut off from the bucket stops answering before the standby takes over, and can never
commit again (fenced). docs/proxy.md, "A standby"."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import journal
from conftest import PY, ROOT, SUPPORT, free_port, stop
from ledger import Ledger
from proxy_client import ProxyClient, endpoint_resolver, read_proxy_endpoint
from proxyproc import Worker, spawn, wait_for, wait_port  # noqa: F401 - spawn is a fixture
from tcp_forward import Forwarder
from test_proxy import group

TERM_S = "1.5"
CHAT = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def pair(spawn):
    """start(*flags, standby=False, env=None, term=TERM_S) -> ProxyProc: proxies of one run sharing a token, each
    advertising its own URL."""
    token = "failover-token"

    def start(*flags, standby=False, env=None, term=TERM_S):
        port = free_port()
        return spawn("--term-s", term, "--advertise-url", f"http://127.0.0.1:{port}", *flags,
                     *(["--standby"] if standby else []), port=port, token=token, env=env)
    return start


def role(p) -> str | None:
    try:
        return p.http.get("/health", timeout=2).json()["role"]
    except Exception:  # noqa: BLE001 - not answering (killed, stopped)
        return None


def gauges(p) -> dict[str, float]:
    """The leadership gauges of a proxy's /metrics (Prometheus text), by name."""
    text = p.http.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(proxy_lead\w*|proxy_standby\w*) (\S+)$", text, re.M)}


def drain(client) -> list[str]:
    out = []
    while (r := client.post("/v1/batches/lease", {"num_groups": 1}))["batch_id"]:
        assert len(out) < 500, "the buffer never empties"
        out += [g["group_id"] for g in r["groups"]]
        assert client.post(f"/v1/batches/{r['batch_id']}/ack") == {"acked": 1}
    return out


def test_kill_9_of_the_leader_the_standby_takes_over_nothing_lost(pair, bucket):
    """Groups accepted, a batch acked, a batch leased and held; the leader is killed. The standby serves within
    seconds; the client (the URL it had is dead) finds it through proxy/endpoint.json, acks the held batch there,
    and every group accepted is acked exactly once; a group sent again is a duplicate."""
    a = pair()
    b = pair(standby=True)
    assert role(a) == "leader" and role(b) == "standby"
    assert read_proxy_endpoint(bucket)["url"] == a.url
    refused = b.http.get("/v1/stats")  # a standby answers nothing but /health and /metrics: clients retry
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    client = ProxyClient(a.url, a.token, patience_s=30, resolve=endpoint_resolver(bucket))
    lost = ProxyClient(a.url, a.token, patience_s=30, resolve=endpoint_resolver(bucket))
    lost.http.base_url = b.url  # a client holding the standby's address: its 503 sends it to the record, the leader
    assert lost.get("/v1/stats")["leadership"]["role"] == "leader" and lost.url == a.url
    accepted = []
    for _ in range(8):
        g = group()
        assert client.post("/v1/groups", g)["status"] == "accepted"
        accepted.append(g["group_id"])
    first = client.post("/v1/batches/lease", {"num_groups": 2})
    assert client.post(f"/v1/batches/{first['batch_id']}/ack") == {"acked": 2}
    held = client.post("/v1/batches/lease", {"num_groups": 3})
    wait_for(lambda: b.http.get("/health").json()["lag_commits"] == 0 and
             b.http.get("/health").json()["last_applied"] == journal.log_keys(bucket)[-1], 20, msg="the standby to catch up")

    # who leads, since when, and the standby's lag: on the leader's /metrics and /v1/stats, and the standby's /metrics
    since = a.stats()["leadership"]["since"]
    assert gauges(a) | {"proxy_leading_seconds": 0} == {"proxy_leader": 1, "proxy_leader_incarnation": 0,
                                                         "proxy_leader_since_seconds": since, "proxy_leading_seconds": 0}
    assert gauges(b) | {"proxy_standby_behind_seconds": 0} == {
        "proxy_leader": 0, "proxy_leader_incarnation": 0, "proxy_leader_since_seconds": since,
        "proxy_standby_lag_commits": 0, "proxy_standby_behind_seconds": 0}

    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait()
    t0 = time.monotonic()
    wait_for(lambda: role(b) == "leader", 15, every=0.05, msg="the standby to take the lead")
    took = time.monotonic() - t0
    assert took < 10, f"takeover took {took:.1f}s"
    assert read_proxy_endpoint(bucket)["url"] == b.url
    took_at = b.stats()["leadership"]["since"]
    assert took_at > since and gauges(b)["proxy_leader_incarnation"] == 1 and gauges(b)["proxy_leader"] == 1
    assert gauges(b)["proxy_leader_since_seconds"] == took_at

    assert client.post(f"/v1/batches/{held['batch_id']}/ack") == {"acked": 3}  # re-resolved: the old URL refuses
    assert client.url == b.url
    assert client.post("/v1/groups", group(gid=accepted[0]))["status"] == "duplicate"
    late = group()
    assert client.post("/v1/groups", late)["status"] == "accepted"
    got = [g["group_id"] for g in first["groups"]] + [g["group_id"] for g in held["groups"]] + drain(client)
    assert sorted(got) == sorted(accepted + [late["group_id"]]), "a group was lost or handed out twice"
    st = client.get("/v1/stats")
    assert st["leadership"]["role"] == "leader" and st["leadership"]["incarnation"] == 1


def test_a_leader_cut_off_from_the_bucket_stops_answering_and_is_fenced(pair, bucket, s3_env):
    """The leader's bucket endpoint goes away (a forwarder killed) while a group's commit is in flight: it answers
    503 once its term is no longer sure, before the standby takes over; when the bucket comes back it finds the
    leader record taken and the journal fenced, and exits without answering the group accepted. The group, sent
    again to the new leader, is accepted there, once: the old leader's commit never entered the log. A routed
    request waiting there (no worker could take or answer it any more) is answered 503 + Retry-After at once, not
    left to its --route.timeout-s."""
    s3_port = s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1]
    fwd_port = free_port()
    fwd_cmd = [PY, str(SUPPORT / "tcp_forward.py"), str(fwd_port), s3_port]
    fwd = subprocess.Popen(fwd_cmd)
    try:
        wait_port(fwd_port, fwd)
        # a longer term than the others': the 0.3-term margin between the two moments is what the polls below see
        a = pair("--bucket-patience-s", "60", env={"S3_ENDPOINT_URL": f"http://127.0.0.1:{fwd_port}"}, term="3")
        b = pair(standby=True, term="3")
        assert a.http.post("/v1/groups", json=group()).json()["status"] == "accepted"
        a.http.post("/v1/inference/lease", json={"worker_id": "w", "max_requests": 1})  # a worker serves (none answers)
        routed = Worker(lambda: a.http.post("/v1/chat/completions", json=CHAT, timeout=60))
        routed.start()
        wait_for(lambda: a.http.get("/v1/inference/stats").json()["waiting"] == 1, 10, msg="the routed request queued")
        fwd.kill()
        fwd.wait()
        g = group()
        inflight = Worker(lambda: a.http.post("/v1/groups", json=g, timeout=60))
        inflight.start()
        t0 = time.monotonic()
        wait_for(lambda: a.http.get("/v1/state", timeout=5).status_code == 503, 10, every=0.02, msg="the cut-off leader to refuse")
        stopped = time.monotonic() - t0
        assert role(b) == "standby", "the standby took over before the old leader stopped answering"
        wait_for(lambda: role(b) == "leader", 15, msg="the standby to take the lead")
        assert time.monotonic() - t0 > stopped
        told = routed.join(10)  # before the bucket is back: the old leader still runs, it did not exit under it
        assert told.status_code == 503 and told.headers["retry-after"] == "1" and told.json()["detail"] == (
            "this proxy could not renew its leadership in time; retry (a standby takes over if it does not recover): "
            "this request was not answered, send it again"), told.text
        fwd = subprocess.Popen(fwd_cmd)  # the bucket is back for the old leader: its renewal and commit meet the new one
        assert a.proc.wait(30) == 3
    finally:
        stop(fwd)
    try:
        answer = inflight.join(30)
    except Exception:  # noqa: BLE001 - the connection closed under it: an error, never a success
        answer = None
    assert answer is None or answer.status_code != 200, answer.text
    assert b.http.post("/v1/groups", json=g).json()["status"] == "accepted"
    led = Ledger(max_staleness=3, lease_s=300.0)
    for key, blob in journal.read_objects(bucket, journal.log_keys(bucket)):
        led.apply_object(key, blob)
    assert led.fenced.get(0) is not None, "the new leader did not fence the old one"
    assert g["group_id"] in led.buffer and led.counts["groups_accepted"] == 2


def test_a_hung_leader_is_deposed_and_exits_when_it_wakes(pair, bucket):
    """SIGSTOP: alive, answering nothing. The standby takes the lead; the old one, continued, answers 503 at once
    (its term ran out on its own clock while it was stopped) and exits (its record was taken)."""
    a = pair()
    b = pair(standby=True)
    ids = []
    for _ in range(3):
        g = group()
        assert a.http.post("/v1/groups", json=g).json()["status"] == "accepted"
        ids.append(g["group_id"])
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: role(b) == "leader", 15, msg="the standby to take the lead")
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    r = None
    try:
        r = a.http.post("/v1/batches/lease", json={"num_groups": 1}, timeout=5)
    except Exception:  # noqa: BLE001 - it may be gone already
        pass
    assert r is None or r.status_code == 503, r.text
    assert a.proc.wait(15) == 3
    got = b.http.post("/v1/batches/lease", json={"num_groups": 3}).json()
    assert sorted(x["group_id"] for x in got["groups"]) == sorted(ids)


def test_a_standby_started_late_catches_up(pair, bucket):
    """A standby started after a snapshot and more commits holds the leader's state: its /v1/state once it leads
    equals the leader's before the kill (the buffer in order, the open lease, the counts)."""
    a = pair("--snapshot-commits", "5")
    for _ in range(12):
        assert a.http.post("/v1/groups", json=group()).json()["status"] == "accepted"
    held = a.http.post("/v1/batches/lease", json={"num_groups": 4}).json()
    wait_for(lambda: bucket.list(journal.SNAPSHOTS), 20, msg="a snapshot")
    for _ in range(5):
        assert a.http.post("/v1/groups", json=group()).json()["status"] == "accepted"
    b = pair(standby=True)
    assert "following the journal from snapshot" in open(b.log).read()
    wait_for(lambda: b.http.get("/health").json()["last_applied"] == journal.log_keys(bucket)[-1], 20,
             msg="the late standby to catch up")
    before = a.http.get("/v1/state").json()
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait()
    wait_for(lambda: role(b) == "leader", 15, msg="the standby to take the lead")
    after = b.http.get("/v1/state").json()
    assert after["buffer"] == before["buffer"] and after["leases"] == before["leases"] == {held["batch_id"]: [
        g["group_id"] for g in held["groups"]]}
    assert after["counts"] == before["counts"] and after["counts"]["groups_accepted"] == 17


def test_both_proxies_killed_at_once_and_started_again_then_a_clean_stop(pair, bucket):
    """Leader and standby killed together: started again, the one without --standby leads (it fences the last
    writer), the other follows, and nothing is lost: the held batch acks, every other group is buffered.
    Then SIGTERM of that leader while a routed request waits for a worker: the client is answered 503 + Retry-After
    at once (uvicorn waits for every request in progress before the proxy releases its term: a routed wait of
    --route.timeout-s would hold the takeover up that long), the leader stops cleanly and the standby leads."""
    a = pair()
    b = pair(standby=True)
    for _ in range(6):
        assert a.http.post("/v1/groups", json=group()).json()["status"] == "accepted"
    held = a.http.post("/v1/batches/lease", json={"num_groups": 2}).json()
    for p in (a, b):
        os.kill(p.proc.pid, signal.SIGKILL)
    for p in (a, b):
        p.proc.wait()
    c = pair()
    d = pair(standby=True)
    assert role(c) == "leader" and role(d) == "standby"
    assert read_proxy_endpoint(bucket)["url"] == c.url
    assert c.http.post(f"/v1/batches/{held['batch_id']}/ack").json() == {"acked": 2}
    st = c.stats()
    assert st["buffer_size"] == 4 and st["groups_accepted"] == 6 and st["leadership"]["incarnation"] == 1

    c.http.post("/v1/inference/lease", json={"worker_id": "w", "max_requests": 1})  # a worker serves (none answers)
    routed = Worker(lambda: c.http.post("/v1/chat/completions", json=CHAT, timeout=60))
    routed.start()
    wait_for(lambda: c.http.get("/v1/inference/stats").json()["waiting"] == 1, 10, msg="the routed request queued")
    c.proc.terminate()
    told = routed.join(10)
    assert told.status_code == 503 and told.headers["retry-after"] == "1" and told.json()["detail"] == (
        "this proxy is stopping; retry (proxy/endpoint.json names the next leader): this request was not answered, "
        "send it again"), told.text
    assert c.proc.wait(15) == -signal.SIGTERM and "proxy: stopped cleanly" in open(c.log).read()  # (uvicorn re-raises it)
    wait_for(lambda: role(d) == "leader", 5, msg="the standby to take the lead from a released record")
    assert read_proxy_endpoint(bucket)["url"] == d.url and d.stats()["buffer_size"] == 4


def test_a_standby_without_a_bucket_or_a_term_is_refused_at_the_start():
    """--standby follows the journal in the bucket and the leader's term: without either it could never take over."""
    bad = subprocess.run([sys.executable, str(ROOT / "proxy.py"), "--standby", "--no-use-bucket", "--term-s", "-1"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    for problem in ("--term-s -1.0: must be at least 0", "--standby: needs the bucket",
                    "--standby: needs --term-s above 0"):
        assert problem in bad.stderr, bad.stderr


@pytest.mark.parametrize("ignored", ["if-none-match", "if-match"])
def test_a_store_that_ignores_conditional_writes_is_refused_at_the_start(s3_env, run_name, ignored):
    """The fence (If-None-Match) and the leader record (If-Match) rest on the store refusing conditional writes that
    fail: a store that ignores either header (a forwarder takes it out of every request on its way to the S3 server)
    would let a fenced proxy, or two leaders, commit. A proxy does not start on it, standby or not, and says why; on
    the S3 server itself the same start serves."""
    fwd = Forwarder(int(s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1]), lambda *_: False, drop_headers={ignored})
    try:
        env = {**os.environ, "RUN_NAME": run_name, "PROXY_TOKEN": "t",
               "S3_ENDPOINT_URL": f"http://127.0.0.1:{fwd.port}"}
        cmd = [sys.executable, str(ROOT / "proxy.py"), "--port", str(free_port()), "--term-s", "2"]
        for flags in ([], ["--standby"]):
            bad = subprocess.run([*cmd, *flags], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
            what = {"if-none-match": "If-None-Match: * over an object that exists",
                    "if-match": "If-Match with an ETag the object does not have"}[ignored]
            assert "not starting: the bucket does not honour conditional writes" in bad.stderr, bad.stderr[-3000:]
            where = f"(s3://tests/{run_name}/proxy/checks/"
            assert f"a put with {what} was accepted {where}" in bad.stderr, bad.stderr[-3000:]
    finally:
        fwd.close()
