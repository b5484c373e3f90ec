"""kill -9 the real proxy at random moments while groups are submitted and batches leased and acked,
restart it on the same bucket, and check that nothing acknowledged was lost or handed out twice."""
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx

import journal
from conftest import ROOT, free_port, wait_http
from proxyproc import wait_for
from test_proxy import group, publish


class Restartable:
    """proxy.py on a fixed port and run, killed with SIGKILL and started again."""

    def __init__(self, run_name: str, log_dir, *flags: str):
        self.port, self.token, self.flags, self.log_dir = free_port(), secrets.token_urlsafe(16), flags, log_dir
        self.env = {**os.environ, "RUN_NAME": run_name, "PROXY_TOKEN": self.token}
        self.url, self.proc, self.starts = f"http://127.0.0.1:{self.port}", None, 0

    def start(self) -> None:
        log = open(self.log_dir / f"proxy-{self.starts}.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "proxy.py"), "--port", str(self.port), *self.flags],
                                     env=self.env, stdout=log, stderr=log)
        self.starts += 1
        wait_http(f"{self.url}/health", self.proc, timeout=60)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


CALL_PATIENCE_S = 120  # one call retried through a dead proxy gives up after this (a restart takes seconds)


def test_kill_9_loses_nothing_and_trains_nothing_twice(bucket, run_name, tmp_path, seed):
    # a snapshot every 5 commits: the kills land before, during and after snapshot writes, and each start
    # reads a snapshot and the commits after it
    rng, trainer_rng = random.Random(seed), random.Random(seed + 1)  # the kills' moments; "the optimizer step"
    px = Restartable(run_name, tmp_path, "--group-size", "4", "--lease-s", "4", "--max-buffer", "100000",
                     "--max-staleness", "100", "--snapshot-commits", "5")
    px.start()
    up_since = time.monotonic()
    http = httpx.Client(base_url=px.url, headers={"X-Proxy-Token": px.token}, timeout=10)
    stop, holding = threading.Event(), threading.Event()
    ok: set[str] = set()                      # groups that got a 2xx
    trained: list[tuple[str, list[str]]] = []  # batches whose ack got 200 (or 409 on a retry: acked before the kill)
    prompts: list[tuple[int, int]] = []        # (epoch, index) handed out
    errors: list[str] = []
    # every request that lost its answer to a broken connection: (sent at, failed at, what); the ones sent
    # while the proxy was up and cut at a kill show that the kill landed on requests in flight
    lost: list[tuple[float, float, str]] = []

    def call(method, path, retried=None, **kw):
        """Retry through the proxy being dead (for CALL_PATIENCE_S at most); return the first answer."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < CALL_PATIENCE_S:
            sent = time.monotonic()
            try:
                return http.request(method, path, **kw)
            except httpx.TransportError as e:
                if not isinstance(e, httpx.ConnectError):  # connected, then no answer: cut mid-request
                    lost.append((sent, time.monotonic(), f"{method} {path.split('/')[2]}"))
                if stop.is_set() and path == "/v1/groups":
                    return None
                if retried is not None:
                    retried.append(1)
                time.sleep(0.05)
        raise TimeoutError(f"{method} {path}: no answer from the proxy for {CALL_PATIENCE_S} s")

    def submitter():
        while not stop.is_set():
            g = group(gid=uuid.uuid4().hex)
            r = call("POST", "/v1/groups", json=g)  # the same group_id again after a connection error
            if r is not None and r.status_code == 200:
                ok.add(g["group_id"])
            elif r is not None:
                errors.append(f"submit {r.status_code} {r.text[:200]}")

    def trainer():
        while not stop.is_set():
            r = call("POST", "/v1/batches/lease", json={"num_groups": 4, "wait_s": 0.2})
            if r.status_code != 200 or not r.json()["batch_id"]:
                continue
            lease = r.json()
            holding.set()  # a kill now is a kill during a lease
            time.sleep(trainer_rng.uniform(0.0, 0.3))  # "the optimizer step"
            retried = []
            a = call("POST", f"/v1/batches/{lease['batch_id']}/ack", retried)
            # 409 after a retry: the ack was written before the kill, only its answer was lost
            if a.status_code == 200 or (a.status_code == 409 and retried):
                trained.append((lease["batch_id"], [g["group_id"] for g in lease["groups"]]))
            elif a.status_code != 410:  # 410: the lease ran out while the proxy was down; groups went back
                errors.append(f"ack {a.status_code} {a.text[:200]}")
            holding.clear()

    def prompter():
        while not stop.is_set():
            r = call("POST", "/v1/prompts/lease", json={"dataset": "d", "size": 40, "n": 3})
            if r.status_code == 200:
                prompts.extend(zip(r.json()["epochs"], r.json()["indices"]))
            time.sleep(0.05)

    def running(f):
        def run():
            try:
                f()
            except Exception as e:  # noqa: BLE001 - a client thread that dies says why, and the test fails
                errors.append(f"{f.__name__}: {type(e).__name__}: {e}")
        return run

    threads = [threading.Thread(target=running(f), daemon=True) for f in (submitter, submitter, trainer, prompter)]
    for t in threads:
        t.start()
    # the first snapshot before the first kill: from then on every start must read one (a snapshot is never
    # deleted). Without this wait a loaded machine may kill the first proxies before they wrote any (the
    # writer looks once a second), and how many starts read a snapshot would depend on the load
    wait_for(lambda: bucket.list(journal.SNAPSHOTS), 120, 0.1, "the proxy's first snapshot")
    kills, during_lease, version = [], 0, 0  # kills: (the proxy up since, killed at)
    for k in range(6):
        time.sleep(rng.uniform(0.3, 2.0))
        if k % 2 == 1:  # every other kill waits for the trainer to hold an unacked lease
            holding.wait(20)
        during_lease += holding.is_set()
        kills.append((up_since, time.monotonic()))
        px.kill()
        px.start()
        up_since = time.monotonic()
        # versions continue across restarts, and the next one registers
        assert http.get("/v1/adapters/latest").json()["version"] == version
        version += 1
        publish(bucket, type("P", (), {"http": http}), version)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(CALL_PATIENCE_S + 30)
    assert not [t for t in threads if t.is_alive()], "a client thread never finished"
    assert not errors, errors[:5]
    # each kill cut requests in flight: sent while that proxy was up, answer lost as it died
    cut = [[what for sent, failed, what in lost if up <= sent < killed <= failed] for up, killed in kills]
    print("\nrequests cut by each kill:", [sorted(set(c)) for c in cut])
    assert sum(bool(c) for c in cut) >= 5 and during_lease >= 1, (cut, during_lease)
    assert len(ok) > 20 and len(trained) > 3, (len(ok), len(trained))

    # one more kill and restart, then drain: every 2xx group is trained or still leasable, exactly once
    px.kill()
    px.start()
    t0 = time.time()  # open leases of the dead trainer run out (lease_s=4, from the restart)
    while (open_leases := http.get("/v1/stats").json()["open_leases"]) and time.time() - t0 < 60:
        time.sleep(0.2)
    assert open_leases == 0, f"{open_leases} leases still open 60 s after the restart (lease_s=4)"
    drained = []
    for _ in range(len(ok) + 1000):  # one group a lease: the 2xx ones and a few whose answer was lost, then none
        if not (r := http.post("/v1/batches/lease", json={"num_groups": 1})).json()["batch_id"]:
            break
        drained += [g["group_id"] for g in r.json()["groups"]]
        assert http.post(f"/v1/batches/{r.json()['batch_id']}/ack").status_code == 200
    else:
        raise AssertionError(f"the drain went on past {len(ok) + 1000} groups ({len(ok)} got a 2xx)")
    consumed = [g for _, gids in trained for g in gids] + drained
    assert len(consumed) == len(set(consumed)), "a group was handed out again after its batch was acked"
    assert ok <= set(consumed), f"{len(ok - set(consumed))} acknowledged groups were lost"

    # the bucket's journal agrees: no group in two acked batches, every 2xx group in exactly one
    events = []  # the journal's event lines (the others are the accepted groups)
    for key in sorted(bucket.list("rollouts/")):
        events += [json.loads(line) for line in bucket.get(key)[0].splitlines() if line.startswith(b'{"t"')]
    leases = {e["batch_id"]: e["group_ids"] for e in events if e["t"] == "lease"}
    acked = [g for e in events if e["t"] == "ack" for g in leases[e["batch_id"]]]
    assert len(acked) == len(set(acked)) and ok <= set(acked)
    assert {b for b, _ in trained} <= {e["batch_id"] for e in events if e["t"] == "ack"}

    # the registry and the prompt cursor continued through all restarts
    assert http.get("/v1/adapters/latest").json()["version"] == version == 6
    by_epoch: dict[int, list[int]] = {}
    for e, i in prompts:
        by_epoch.setdefault(e, []).append(i)
    assert all(len(ix) == len(set(ix)) for ix in by_epoch.values()), "a prompt index was handed out twice in an epoch"
    assert len(prompts) > 40  # at least one epoch boundary was crossed
    st = http.get("/v1/stats").json()
    assert st["incarnation"] == px.starts - 1 and st["groups_accepted"] >= len(ok) and st["buffer_size"] == 0
    starts = [open(tmp_path / f"proxy-{i}.log").read() for i in range(1, px.starts)]
    assert all("state from snapshot proxy/snapshots/" in log for log in starts), "every restart read a snapshot"
    px.kill()


def test_journal_keeps_compact_bytes_and_reencodes_the_rest_across_a_restart(bucket, run_name, tmp_path):
    """A group sent as one compact line leading with id, worker and version is journaled and leased out as
    the very bytes sent; any other spelling of a valid group (pretty-printed, keys in another order) is
    re-encoded canonically. Both replay after kill -9 and lease out with the values that were sent."""
    px = Restartable(run_name, tmp_path, "--group-size", "4")
    px.start()
    try:
        http = httpx.Client(base_url=px.url, headers={"X-Proxy-Token": px.token}, timeout=10)
        compact, pretty, reordered = group(), group(), group()
        # -5e-1 rather than -0.5: a re-encoding would not spell it this way
        bodies = {compact["group_id"]: json.dumps(compact, separators=(",", ":")).encode().replace(b"-0.5", b"-5e-1"),
                  pretty["group_id"]: json.dumps(pretty, indent=2).encode(),  # newlines: cannot be a journal line
                  reordered["group_id"]: json.dumps(dict(reversed(list(reordered.items()))), separators=(",", ":")).encode()}
        for body in bodies.values():
            r = http.post("/v1/groups", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
        lines = [line for k in sorted(bucket.list("rollouts/")) for line in bucket.get(k)[0].splitlines()]
        assert bodies[compact["group_id"]] in lines and b"-5e-1" in bodies[compact["group_id"]]  # byte for byte
        for g in (pretty, reordered):
            # the group's own line (a receipt record in the same commit names its id too: receipts.py)
            [line] = [x for x in lines if x.startswith(b'{"group_id":"%s"' % g["group_id"].encode())]
            assert line.startswith(b'{"group_id":"%s","worker_id":"w1","policy_version":0,' % g["group_id"].encode())
            assert json.loads(line) == g
        px.kill()
        px.start()
        http = httpx.Client(base_url=px.url, headers={"X-Proxy-Token": px.token}, timeout=10)
        r = http.post("/v1/batches/lease", json={"num_groups": 3})
        assert r.status_code == 200
        assert {g["group_id"]: g for g in r.json()["groups"]} == {g["group_id"]: g for g in (compact, pretty, reordered)}
        assert http.post(f"/v1/batches/{r.json()['batch_id']}/ack").json() == {"acked": 3}
    finally:  # a failed assertion must not leave the proxy running
        px.kill()
