"""One home for the proxy's rules (book.py): the same random traffic drives the live proxy and, through
its journal, a replay (ledger.Ledger), and both end in the same state, field by field (group ids in buffer
order, open leases, the duplicate window, acked and expired batches, versions, counts). A restart of the
proxy (snapshot + tail) reaches it too."""
import os
import random
import signal
import time

import journal
from ledger import Ledger
from proxyproc import spawn  # noqa: F401 - a fixture
from test_ledger import FLAGS, LIMITS, drive


def settled(p) -> dict:
    """The live state once nothing is in flight: every abandoned lease has run out and been journaled."""
    deadline = time.time() + 60
    while time.time() < deadline:
        st = p.stats()
        if st["open_leases"] == 0 and st["pending_writes"] == 0:
            state = p.http.get("/v1/state").json()
            if p.stats()["pending_writes"] == 0 and p.http.get("/v1/state").json() == state:
                return state
        time.sleep(0.2)
    raise TimeoutError(f"the proxy did not settle: {p.stats()}")


def test_live_state_equals_its_replay_and_its_restart(bucket, spawn, seed):
    rng, book = random.Random(seed), {"version": 0}
    p = spawn(*FLAGS)
    drive(p, bucket, rng, 60, book)
    live = settled(p)
    assert live["counts"]["leases_expired"] > 0 and live["counts"]["groups_duplicate"] > 0
    assert live["counts"]["groups_dropped_stale"] > 0 and live["acked"] and live["buffer"]
    # the trust records too (docs/trust.md): prompt leases bound and used, lies counted, a quarantine and a reinstatement
    trust = live["quarantine"]["mallory"]
    assert live["receipts"]["leases"] and live["receipts"]["prints"] and trust["checked"] > 0, live["quarantine"]
    assert "reinstated_at" in trust and {r["check"] for r in trust["recent"]} & {"unleased", "reused", "replayed"}, trust
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()

    replay = Ledger(**LIMITS)
    for key, blob in journal.read_objects(bucket, journal.log_keys(bucket)):
        replay.apply_object(key, blob)
    replayed = replay.state()
    for k in live:
        assert replayed[k] == live[k], f"replay: {k} differs: {str(replayed[k])[:300]} != {str(live[k])[:300]}"

    q = spawn(*FLAGS)
    restarted = q.http.get("/v1/state").json()
    for k in live:
        assert restarted[k] == live[k], f"restart: {k} differs: {str(restarted[k])[:300]} != {str(live[k])[:300]}"
