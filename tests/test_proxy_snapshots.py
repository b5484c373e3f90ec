"""Snapshots against the real proxy process and the real S3 server: a kill -9 in the middle of a snapshot
write loses nothing (the cut-short snapshot never counts), a torn snapshot is skipped for the newest one
that verifies, and the duplicate window holds across a restart that reads nothing but a snapshot. A run
written in another protocol is refused at the start, untouched."""
import os
import signal
import subprocess
import sys
import time

import pytest

import journal
from common import PROTOCOL, ProtocolError
from conftest import ROOT, SUPPORT, free_port, stop, wait_http
from ledger import Ledger
from proxyproc import spawn, wait_for, wait_port  # noqa: F401 - spawn is a fixture
from test_proxy import group, publish


def kill(p) -> None:
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()


def snapshot_covers_last_commit(bucket) -> bool:
    pointer = bucket.get_json(journal.POINTER)
    return bool(pointer) and pointer["covers"] == journal.log_keys(bucket)[-1]


def drain(p) -> list[str]:
    """Lease and ack one group at a time until none is left (bounded: the buffer holds fewer than 1000 here)."""
    out = []
    while (r := p.http.post("/v1/batches/lease", json={"num_groups": 1}).json())["batch_id"]:
        assert len(out) < 1000, "the buffer never empties"
        out += [g["group_id"] for g in r["groups"]]
        assert p.http.post(f"/v1/batches/{r['batch_id']}/ack").status_code == 200
    return out


def full_replay(bucket) -> Ledger:
    led = Ledger(max_staleness=3, lease_s=300.0)
    for key, blob in journal.read_objects(bucket, journal.log_keys(bucket)):
        led.apply_object(key, blob)
    return led


def test_kill_9_during_a_snapshot_write_loses_nothing(s3_env, bucket, spawn, tmp_path):
    """The second snapshot's upload is cut short halfway (its PUT stalls in a forwarder) and the proxy is
    killed while it hangs; answers go on meanwhile. The restart reads the first snapshot and every commit
    after it: every group answered `accepted` is acked or buffered, once."""
    fwd_port, s3_port = free_port(), s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1]
    log = open(tmp_path / "stall.log", "w")
    fwd = subprocess.Popen([sys.executable, str(SUPPORT / "lossy_forward.py"), str(fwd_port), s3_port,
                            f"/{journal.SNAPSHOTS}", "1", "stall", "1"], stdout=log, stderr=log)
    accepted, acked = [], []

    def work(p, n: int) -> None:
        for _ in range(n):
            g = group()
            assert p.http.post("/v1/groups", json=g).json()["status"] == "accepted"
            accepted.append(g["group_id"])
        r = p.http.post("/v1/batches/lease", json={"num_groups": 2}).json()
        assert p.http.post(f"/v1/batches/{r['batch_id']}/ack").json() == {"acked": 2}
        acked.extend(g["group_id"] for g in r["groups"])

    try:
        wait_port(fwd_port, fwd)
        p = spawn("--snapshot-commits", "4", "--snapshot-s", "3600", env={"S3_ENDPOINT_URL": f"http://127.0.0.1:{fwd_port}"})
        t0 = time.monotonic()
        while "stalled PUT" not in open(log.name).read():
            assert time.monotonic() - t0 < 120, "no second snapshot was attempted"
            work(p, 3)
        first = bucket.list(journal.SNAPSHOTS)
        assert len(first) == 1 and bucket.get_json(journal.POINTER)["key"] == first[0]
        for _ in range(3):  # the snapshot write hangs; no answer waits for it
            work(p, 3)
        kill(p)
    finally:
        stop(fwd)
    assert bucket.list(journal.SNAPSHOTS) == first  # the cut-short upload stored nothing

    q = spawn()
    assert f"state from snapshot {first[0]} and " in open(q.log).read()
    st = q.stats()
    assert st["groups_accepted"] == len(accepted) and st["groups_acked"] == len(acked) and st["open_leases"] == 0
    for gid in accepted[:5] + accepted[-5:]:  # inside the window, from the snapshot and from the commits after it
        assert q.http.post("/v1/groups", json=group(gid=gid)).json()["status"] == "duplicate"
    rest = drain(q)
    assert sorted(acked + rest) == sorted(accepted), "a group was lost or handed out twice"


def test_a_torn_snapshot_is_skipped_for_the_newest_one_that_verifies(bucket, spawn):
    p = spawn("--snapshot-commits", "3")
    rounds = 0
    while len(bucket.list(journal.SNAPSHOTS)) < 3 or rounds < 6:  # 4 groups in, 3 acked, a snapshot in between
        assert rounds < 60, f"{rounds} rounds of 6 commits and fewer than 3 snapshots (--snapshot-commits 3)"
        for _ in range(4):
            assert p.http.post("/v1/groups", json=group()).json()["status"] == "accepted"
        r = p.http.post("/v1/batches/lease", json={"num_groups": 3}).json()
        assert p.http.post(f"/v1/batches/{r['batch_id']}/ack").status_code == 200
        rounds += 1
        time.sleep(1.1)
    kill(p)
    good = bucket.get_json(journal.POINTER)["key"]
    blob = bucket.get(good)[0]
    # newer names than any real snapshot: one cut short, one with a byte changed; the pointer names the first
    torn, changed = (f"{journal.SNAPSHOTS}999999-9999999{i}.999999.json" for i in (9, 8))
    bucket.put(torn, blob[:len(blob) // 2])
    bucket.put(changed, blob.replace(b'"done":false', b'"done":fals3', 1))
    bucket.put_json(journal.POINTER, {"key": torn, "covers": "rollouts/999999-99999999.jsonl"})

    q = spawn()
    log = open(q.log).read()
    assert f"ignoring snapshot {torn}: cut short" in log and f"ignoring snapshot {changed}: its checksum" in log
    assert f"state from snapshot {good} and " in log
    full, st = full_replay(bucket), q.stats()
    for k, v in full.counters().items():
        assert st[k] == v, (k, st[k], v)
    assert st["buffer_size"] == len(full.buffer) == rounds
    assert sorted(drain(q)) == sorted(full.buffer)


def test_the_duplicate_window_holds_across_a_restart_from_a_snapshot(bucket, spawn):
    """max_staleness 1. Before the kill: g0 (version 0) leased and acked, g1 (version 1) leased, not acked.
    The restart reads only a snapshot. Within the window both are `duplicate` and the ack retried is 409;
    once version 2 moves the window past version 0, g0 sent again is `stale` (it could not be trained
    anyway), g1 still `duplicate`. A restart with a larger max_staleness does not reopen the window."""
    flags = ("--max-staleness", "1", "--snapshot-commits", "1")
    p = spawn(*flags)
    g0, g1 = group(version=0), None
    assert p.http.post("/v1/groups", json=g0).json()["status"] == "accepted"
    publish(bucket, p, 1)
    g1 = group(version=1)
    assert p.http.post("/v1/groups", json=g1).json()["status"] == "accepted"
    b0 = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()
    assert [g["group_id"] for g in b0["groups"]] == [g0["group_id"]]
    assert p.http.post(f"/v1/batches/{b0['batch_id']}/ack").status_code == 200
    b1 = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()
    assert [g["group_id"] for g in b1["groups"]] == [g1["group_id"]]
    wait_for(lambda: snapshot_covers_last_commit(bucket))
    kill(p)

    q = spawn(*flags)
    assert " and 0 commits in " in open(q.log).read()  # everything below comes from the snapshot
    assert q.stats()["duplicate_window"] == {"groups": 2, "min_version": 0}
    for g in (g0, g1):
        assert q.http.post("/v1/groups", json=g).json()["status"] == "duplicate"
    again = q.http.post(f"/v1/batches/{b0['batch_id']}/ack")
    assert again.status_code == 409 and "already acked" in again.text
    assert q.http.post(f"/v1/batches/{b1['batch_id']}/renew").status_code == 200  # the lease survived too
    publish(bucket, q, 2)
    assert q.http.post("/v1/groups", json=g0).json()["status"] == "stale"
    assert q.http.post("/v1/groups", json=g1).json()["status"] == "duplicate"
    late = group(version=0)  # refused on arrival is not remembered: `stale` again
    assert [q.http.post("/v1/groups", json=late).json()["status"] for _ in range(2)] == ["stale", "stale"]
    st = q.stats()
    assert st["duplicate_window"] == {"groups": 1, "min_version": 1} and st["groups_duplicate"] == 3
    wait_for(lambda: snapshot_covers_last_commit(bucket))
    kill(q)

    r = spawn("--max-staleness", "5")
    assert r.http.post("/v1/groups", json=g0).json()["status"] == "stale"
    assert r.http.post("/v1/groups", json=group(version=0)).json()["status"] == "stale"
    assert r.http.post("/v1/groups", json=g1).json()["status"] == "duplicate"
    assert r.http.post(f"/v1/batches/{b1['batch_id']}/ack").json() == {"acked": 1}


def test_a_second_proxy_on_the_run_fences_off_the_first(bucket, spawn):
    """Two proxies on one run at once (a relaunch while the old job still runs, one started by hand): the later
    start writes a fence at the first one's next journal key. The first stops at its next write (exit 3) and
    never answers that request 2xx; a put of it that lands after the fence anyway is not part of the log;
    the second, and any later start, sees exactly the groups that were answered `accepted`."""
    a = spawn()
    g1, g2, g3 = group(version=0), group(version=0), group(version=0)
    assert a.http.post("/v1/groups", json=g1).json()["status"] == "accepted"
    last_a = journal.log_keys(bucket)[-1]

    b = spawn()
    inc_a, seq_a = (int(x) for x in last_a.rsplit("/", 1)[1].split(".")[0].split("-"))
    fence = bucket.get(journal.object_name(inc_a, seq_a + 1))[0]
    assert b'"t":"fence"' in fence and f'"by":{inc_a + 1}'.encode() in fence
    try:
        answer = a.http.post("/v1/groups", json=g2).status_code
    except Exception:  # noqa: BLE001 - the process is gone before it answers: what a client usually sees
        answer = None
    assert answer is None or answer >= 500
    assert a.proc.wait(timeout=30) == 3
    assert "Another proxy is journaling to this run" in open(a.log).read()

    # what a put of the first proxy already in flight would have left: a commit after its fence
    orphan = journal.encode({"t": "commit", "protocol": PROTOCOL, "incarnation": inc_a, "seq": seq_a + 2, "writer": "a",
                             "time": time.time()}, [journal._dumps(g3)])
    bucket.put(journal.object_name(inc_a, seq_a + 2), orphan, if_none_match=True)

    assert b.http.post("/v1/groups", json=g2).json()["status"] == "accepted"
    assert b.http.post("/v1/groups", json=g1).json()["status"] == "duplicate"
    kill(b)
    c = spawn()
    assert f"incarnation {inc_a} was fenced off after seq {seq_a}" in open(c.log).read()
    assert sorted(drain(c)) == sorted([g1["group_id"], g2["group_id"]])  # not g3, never answered
    assert full_replay(bucket).fenced[inc_a] == seq_a  # (and c fenced b off at its start)


def test_a_start_on_a_run_of_another_protocol_refuses_it_and_writes_nothing(s3_env, bucket, run_name, tmp_path):
    """A journal written in another protocol (here a commit header without "protocol", as every proxy wrote before
    protocols were numbered) is not read: the proxy stops at its start, naming both protocols and what to do, and
    writes nothing to the run (no fence, no config, no snapshot). A snapshot of another protocol is refused alike."""
    header = {"t": "commit", "incarnation": 0, "seq": 0, "writer": "old-proxy", "time": time.time()}
    bucket.put(journal.object_name(0, 0), journal.encode(header, [journal._dumps(group(version=0)),
                                                                  {"t": "counters", "counters": {}}]))
    run = lambda: {k: bucket.get(k)[0] for k in bucket.list("")}  # noqa: E731 - everything under the run's prefix
    before = run()
    log, port = tmp_path / "proxy.log", free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "proxy.py"), "--port", str(port), "--group-size", "4"],
                            env={**os.environ, "RUN_NAME": run_name, "PROXY_TOKEN": "t"}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    try:
        with pytest.raises(RuntimeError, match="exited with 2 while starting"):  # not serving: stopped at its start
            wait_http(f"http://127.0.0.1:{port}/health", proc, timeout=120)
    finally:
        stop(proc)
    said = log.read_text()
    assert (f"the journal object {journal.object_name(0, 0)} speaks protocol 1 (from before protocols were numbered); "
            f"this code speaks protocol {PROTOCOL}: finish that run with the clone") in said, said[-2000:]
    assert "or start a new run" in said
    assert run() == before  # nothing written: not a fence, not the proxy's config, not a snapshot

    snapshot = {**Ledger(max_staleness=3, lease_s=300.0).to_snapshot(), "protocol": PROTOCOL - 1}
    with pytest.raises(ProtocolError, match=f"the snapshot s.json speaks protocol {PROTOCOL - 1}; this code speaks "
                                            f"protocol {PROTOCOL}: finish that run"):
        Ledger.from_snapshot(snapshot, max_staleness=3, lease_s=300.0, name="s.json")
