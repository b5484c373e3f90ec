"""The journal's meaning (ledger.py) and the snapshots built from it: a start from a snapshot plus the
commits after it rebuilds, field by field, the state a replay of every commit builds, at any cut point
and for every snapshot the running proxy wrote; and nothing the ledger keeps grows with the run."""
import json
import os
import random
import signal
import threading
import time
import uuid

import pytest

import journal
from ledger import BATCHES, Ledger
from proxyproc import Worker, spawn, wait_for  # noqa: F401 - spawn is a fixture
from test_proxy import group, publish
from test_proxy_access import as_, create, leased, open_dataset, own

# --max-buffer: the traffic is random, not paced; the default (the staleness window) would answer it 429
FLAGS = ("--max-staleness", "2", "--lease-s", "1", "--snapshot-commits", "7", "--quarantine-after", "2", "--max-buffer", "512")
LIMITS = {"max_staleness": 2, "lease_s": 1.0}


def drive(p, bucket, rng: random.Random, rounds: int, book: dict) -> None:
    """Random traffic of every kind the journal records, from the admin token and two participants', with a
    second submitter alongside (commits of several records): new groups, stale ones, resubmissions, leases
    acked, renewed, or abandoned to expire, versions, prompt leases; and the trust records: groups bound to
    prompt leases, lies of every kind the proxy catches (unleased, reused, replayed), the trainer's audit
    reports, a participant quarantined and reinstated. `book` carries over between calls."""
    alice = as_(p, book.setdefault("alice", None) or create(p, "alice"))
    mallory = as_(p, book.setdefault("mallory", None) or create(p, "mallory"))
    book["alice"], book["mallory"] = alice.headers["x-proxy-token"], mallory.headers["x-proxy-token"]
    for dataset, size in [("bound", 1000), ("a", 7), ("b", 7)]:  # the datasets the participants lease, the owner's
        open_dataset(p, dataset, size)
    # the main sequence draws from `rng` alone and resubmits only its own groups, so a seed replays it; the
    # submitter alongside has its own generator (seeded from rng) and its own list
    sent, stop, side_rng = book.setdefault("sent", []), threading.Event(), random.Random(rng.randrange(2**32))
    theirs = book.setdefault("theirs", [])  # participants' accepted groups: what mallory replays

    def submit(client, version: int, r: random.Random, into: list) -> str:
        """A group (bound to a prompt lease of its sender's; the admin's, half the time), kept in `into` to be sent
        again by the same sender (mallory's are not: held out, they may not be in the duplicate window)."""
        lease = {} if client is p.http and r.random() < 0.5 else leased(client, dataset="bound")[0]
        g = own(group(version=version, worker=r.choice(["w1", "w2", "w3"]), **lease))
        answer = client.post("/v1/groups", json=g)
        assert answer.status_code == 200, answer.text
        if client is not mallory:
            into.append(("admin" if client is p.http else "alice", g))
        if into is sent and client is not p.http and answer.json()["status"] == "accepted":
            theirs.append(g)
        return answer.json()["status"]

    def lie(r: random.Random) -> None:
        """One of mallory's lies the proxy catches on arrival: a 409 naming it (or, quarantined, a 403)."""
        kind = r.choice(["unleased", "reused", "replayed"])
        if kind == "replayed" and not theirs:  # no participant's group accepted yet to replay: a reuse instead
            kind = "reused"
        if kind == "replayed":
            g = {**r.choice(theirs), "group_id": uuid.uuid4().hex, **leased(mallory, dataset="bound")[0]}
        else:
            g = own(group(version=book["version"], worker="m1", **leased(mallory, dataset="bound")[0]))
            if kind == "unleased":
                g["lease_id"] = uuid.uuid4().hex
            else:
                assert mallory.post("/v1/groups", json=g).status_code in (200, 403)
                g = own({**g, "group_id": uuid.uuid4().hex})
        answer = mallory.post("/v1/groups", json=g)
        assert answer.status_code in (409, 403) or answer.json()["status"] == "stale", answer.text
        assert answer.status_code != 409 or answer.json()["detail"].split(":")[0] in (kind, "unleased"), answer.text

    def alongside():  # a Worker: an assertion failing in here fails the test at join()
        mine = []
        with as_(p, book["alice"]) as c:
            while not stop.is_set():
                submit(c, book["version"], side_rng, mine)
                time.sleep(0.02)

    def settle(what: str, b: str, since: float) -> int:
        """renew or ack lease b: 200, or 410 if it ran out, which it may only once lease_s has passed since
        `since` (the lease or the renewal was asked for: a loaded machine can take that long in between)."""
        r = p.http.post(f"/v1/batches/{b}/{what}")
        assert r.status_code == 200 or (r.status_code == 410 and time.monotonic() - since >= LIMITS["lease_s"]), r.text
        return r.status_code

    def audit(got: dict) -> None:
        """The trainer's report on a batch: every participant's group checked, some of mallory's failed."""
        ids = [g["group_id"] for g in got["groups"] if g.get("participant")]
        bad = [g["group_id"] for g in got["groups"] if g.get("participant") == "mallory" and rng.random() < 0.5]
        r = p.http.post(f"/v1/batches/{got['batch_id']}/audit", json={
            "checked": ids, "failures": [{"group_id": g, "check": rng.choice(["reward", "prompt", "logprobs"]),
                                          "detail": "made up by the test"} for g in bad]})
        assert r.status_code in (200, 410), r.text  # 410: the lease ran out meanwhile (lease_s 1)

    t = Worker(alongside)
    t.start()
    try:
        for _ in range(rounds):
            latest = book["version"]
            for _ in range(rng.randint(1, 3)):
                client = rng.choice([p.http, alice, mallory])
                if client is mallory and "mallory" in p.stats()["quarantined"]:
                    continue
                assert submit(client, max(0, latest - rng.choice([0, 0, 1])), rng, sent) in ("accepted", "stale")
            if latest > 2 and rng.random() < 0.2:
                assert submit(p.http, latest - 3, rng, sent) == "stale"
            if sent and rng.random() < 0.4:
                who, g = rng.choice(sent)
                assert (alice if who == "alice" else p.http).post("/v1/groups", json=g).json()["status"] in ("duplicate", "stale")
            if rng.random() < 0.25 and "mallory" not in p.stats()["quarantined"]:
                lie(rng)
            if "mallory" in p.stats()["quarantined"] and rng.random() < 0.3:
                assert p.http.post("/v1/participants/mallory/reinstate").status_code == 200
            if rng.random() < 0.6:
                since = time.monotonic()
                got = p.http.post("/v1/batches/lease", json={"num_groups": rng.randint(1, 3)}).json()
                b, what, code = got["batch_id"], rng.random(), 200
                if b and rng.random() < 0.5:
                    audit(got)
                if b and what < 0.2:
                    since, code = time.monotonic(), settle("renew", b, since)
                if b and what < 0.75 and code == 200:
                    settle("ack", b, since)
            if rng.random() < 0.15:
                publish(bucket, p, latest + 1)
                book["version"] = latest + 1
            if rng.random() < 0.3:
                assert alice.post("/v1/prompts/lease", json={"dataset": rng.choice("ab"), "size": 7, "n": 3}).status_code == 200
        # whatever the draw, every trust record at least once: lies up to a quarantine, a reinstatement, and an
        # audit report on a batch holding a group of mallory's (a short or unlucky draw may have none of these)
        for _ in range(10):
            if "mallory" in p.stats()["quarantined"]:
                break
            lie(rng)
        if "mallory" in p.stats()["quarantined"]:
            assert p.http.post("/v1/participants/mallory/reinstate").status_code == 200
        assert submit(mallory, book["version"], rng, sent) == "accepted"
        for _ in range(20):  # lease what is buffered until mallory's group comes (stale groups are dropped on the way)
            since = time.monotonic()  # the lease's start: an ack may find it run out (410) only lease_s after this
            got = p.http.post("/v1/batches/lease", json={"num_groups": max(1, min(1024, p.stats()["buffer_size"]))}).json()
            if got["batch_id"]:
                audit(got)
                settle("ack", got["batch_id"], since)
            if any(g.get("participant") == "mallory" for g in got["groups"]):
                break
        else:
            raise AssertionError("mallory's group was never leased")
        # abandoned leases run out (lease_s 1): expiries are journaled too. Waited for, not slept on
        wait_for(lambda: p.stats()["open_leases"] == 0, 60, msg="every abandoned lease to run out")
    finally:
        stop.set()
        t.join(30)


def kill(p) -> None:
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()


def replayed(blobs: dict, keys: list[str], ledger: Ledger | None = None) -> Ledger:
    ledger = ledger or Ledger(**LIMITS)
    for k in keys:
        ledger.apply_object(k, blobs[k])
    return ledger


def assert_same(a: Ledger, b: Ledger, read, where: str) -> None:
    """Field by field: the ledgers' snapshots, then the live state each hands a start (group lines included)."""
    sa, sb = a.to_snapshot(), b.to_snapshot()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k] == sb[k], f"{where}: {k} differs: {str(sa[k])[:300]} != {str(sb[k])[:300]}"
    la, lb = a.live(read), b.live(read)
    plain = {"window": lambda w: w.state(), "versions": lambda v: v.state(), "senders": lambda s: s.state(),
             "acked": lambda r: list(r.items()), "expired": lambda r: list(r.items()), "buffer": lambda d: list(d.items()),
             "receipts": lambda r: r.state(), "quarantine": lambda q: q.state()}
    for k in la:
        f = plain.get(k, lambda x: x)
        assert f(la[k]) == f(lb[k]), f"{where}: live {k} differs"
    assert not la["lost"] and all(e.raw for e in la["buffer"].values())


@pytest.mark.timeout(600)  # ~40 s alone; 100 rounds of traffic, two proxies and 10 replays took 180 s on a loaded 2-core machine
def test_snapshot_plus_tail_equals_full_replay_at_random_cut_points(bucket, spawn, seed):
    rng, book = random.Random(seed), {"version": 0}
    p = spawn(*FLAGS)
    drive(p, bucket, rng, 50, book)
    kill(p)  # the second incarnation starts from the first one's snapshot and its tail
    q = spawn(*FLAGS)
    assert "state from snapshot proxy/snapshots/" in open(q.log).read()
    drive(q, bucket, rng, 50, book)
    stats = q.stats()
    kill(q)

    keys = journal.log_keys(bucket)
    blobs = dict(journal.read_objects(bucket, keys))
    read = lambda ks: journal.read_objects(bucket, ks)  # noqa: E731
    full = replayed(blobs, keys)
    assert full.counts["groups_accepted"] == stats["groups_accepted"] > 100 and full.counts["leases_expired"] > 0
    assert full.counts["groups_duplicate"] > 0 and full.counts["groups_dropped_stale"] > 0 and full.expired
    assert set(full.senders.participants) == {"admin", "alice", "mallory"} and full.quarantine.people["mallory"]["checked"]
    for cut in sorted(rng.sample(range(1, len(keys)), 10)):
        head = replayed(blobs, keys[:cut])
        restored = Ledger.from_snapshot(json.loads(json.dumps(head.to_snapshot())), **LIMITS)
        assert_same(full, replayed(blobs, keys[cut:], restored), read, f"cut after {cut} of {len(keys)} commits")

    # every snapshot the running proxies wrote (their ledgers fed by their own commits, the second one's
    # started from a snapshot of the first) is the state a replay reaches at the commit it names
    written = bucket.list(journal.SNAPSHOTS)
    assert len({k.rsplit(".", 2)[1] for k in written}) == 2 and len(written) >= 6, written
    for key in written:
        _, covers, state = journal.snapshot_at(bucket, key)
        at = replayed(blobs, keys[:keys.index(covers) + 1])
        assert_same(at, Ledger.from_snapshot(state, **LIMITS), read, key)


def test_nothing_the_ledger_keeps_grows_with_the_run():
    """Synthetic commits as the proxy writes them: 8 groups, then their lease, a version and the ack. The
    snapshot of a run 4x longer is the same size, and each structure stays within its bound."""
    def run(steps: int) -> Ledger:
        led = Ledger(max_staleness=3, lease_s=300.0)
        for step in range(steps):
            gids = [f"{step:06d}{i:026d}" for i in range(8)]
            led.commit(f"rollouts/000000-{2 * step:08d}.jsonl", 1e9 + step, [
                b'{"group_id":"%s","worker_id":"w%d","policy_version":%d,"prompt_ids":[1]}' % (g.encode(), i, step)
                for i, g in enumerate(gids)])
            led.commit(f"rollouts/000000-{2 * step + 1:08d}.jsonl", 1e9 + step, [
                {"t": "lease", "batch_id": f"b{step}", "group_ids": gids, "lease_s": 300.0, "latest": step},
                {"t": "version", "version": step + 1, "step": step + 1, "published_at": 1e9, "final": False},
                {"t": "ack", "batch_id": f"b{step}"}, {"t": "counters", "counters": {}, "staleness_hist": {}}])
        return led

    short, long = run(2 * BATCHES), run(8 * BATCHES)  # 16k and 65k groups
    assert long.counts["groups_acked"] == 8 * 8 * BATCHES and long.latest == 8 * BATCHES
    for led in (short, long):
        assert len(led.window) <= (3 + 1) * 8 and len(led.acked) == BATCHES and not led.buffer and not led.holder
        assert led.versions.ranges == [[1, led.latest]] and len(led.senders.workers) == 8
    size = [len(json.dumps(led.to_snapshot())) for led in (short, long)]
    assert size[1] < 1.01 * size[0], size
