"""Pacing (lib/proxy/pacing.py) through the real proxy: a worker that asks for prompts with wait_s gets them
only when the round it generates can still be trained within max_staleness and within what the trainer will
still lease; otherwise it waits. Under joins, leaves, a crashed worker, a trainer restart and a proxy restart,
and never after the trainer's last batch."""
import asyncio
import bisect
import json
import math
import os
import random
import re
import signal
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

import common
import journal
from ledger import Ledger
from pacing import Grant, Pacer, Waiting, measure, room
from proxyproc import Worker, spawn, wait_for  # noqa: F401 - spawn is a fixture

G = 4  # spawn's --group-size


def ask(p, worker: str, n: int = 4, wait_s: float = 0.0) -> dict:
    r = p.http.post("/v1/prompts/lease", json={"dataset": "d", "size": 1000, "n": n, "worker_id": worker, "wait_s": wait_s})
    assert r.status_code == 200, r.text
    return r.json()


def deliver(p, worker: str, version: int, k: int) -> list[str]:
    """k groups of `worker` generated with `version`: the answers' statuses."""
    out = []
    for _ in range(k):
        g = {"group_id": uuid.uuid4().hex, "worker_id": worker, "policy_version": version, "prompt_ids": [1, 2, 3],
             "completions": [{"token_ids": [5, 6], "logprobs": [-0.5, -1.0], "reward": float(i % 2),
                              "finish_reason": "stop"} for i in range(G)], "meta": {"task": "t"}}
        r = p.http.post("/v1/groups", json=g)
        assert r.status_code == 200, r.text
        out.append(r.json()["status"])
    return out


def answer(s, timeout: float = 30.0) -> bytes:
    """A whole HTTP answer read from socket `s`: its headers, then as many body bytes as content-length says (the two
    may come in separate reads)."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            re.search(rb"content-length: (\d+)", data, re.I)[1]):
        chunk = s.recv(65536)
        assert chunk, f"the connection closed after {data!r}"
        data += chunk
    return data


def lease(p, n: int, left: int | None, wait_s: float = 0.0) -> dict:
    body = {"num_groups": n, "wait_s": wait_s, **({} if left is None else {"groups_left": left})}
    r = p.http.post("/v1/batches/lease", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def register(bucket, p, version: int, final: bool = False) -> None:
    """A real version: adapter files in the bucket, then registered (final: the trainer is done)."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "adapter_model.safetensors").write_bytes(b"x" * 100 + bytes([version % 256]))
        Path(d, "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
        common.publish_adapter(bucket, d, version, version, "m")
    r = p.http.post("/v1/adapters", json={"version": version, "step": version, "published_at": time.time(), "final": final})
    assert r.status_code == 200, r.text


def test_the_window_by_hand():
    """room() on numbers worked out by hand: batches of 4, max_staleness 1. A grant is (lo, hi, version, groups
    left): when its groups may come. The new one is expected between 0.7 and 1.3 unless said otherwise."""
    # the trainer waits (base 0): a group of version 0 must be among the first (1 - 0 + 0 + 1) * 4 = 8 leased
    assert room(4, 0, 0.7, 1.3, 0, [], 0, 4, 1, None) == 4
    assert room(8, 0, 0.7, 1.3, 2, [], 0, 4, 1, None) == 6                 # 2 buffered ahead of it
    assert room(4, 0, 0.7, 1.3, 0, [(0.3, 0.5, 0, 4)], 0, 4, 1, None) == 4  # a grant ahead of it: 4 + 4 <= 8
    assert room(4, 0, 0.7, 1.3, 4, [(0.3, 0.5, 0, 4)], 0, 4, 1, None) == 0  # full
    # it holds a batch (base 1): version 0 only in the first 4
    assert room(4, 0, 0.7, 1.3, 0, [], 1, 4, 1, None) == 4
    assert room(4, 0, 0.7, 1.3, 1, [], 1, 4, 1, None) == 3
    # a new grant that may come before an open one pushes it back: allowed only within that one's slack
    assert room(4, 1, 0.19, 0.21, 0, [(1.9, 2.1, 0, 3)], 1, 4, 1, None) == 1  # version 0 ends at 3 of its 4
    assert room(4, 1, 4.9, 5.1, 0, [(1.9, 2.1, 0, 3)], 1, 4, 1, None) == 4    # after it: pushes nothing, 3 + 4 <= 8
    assert room(4, 1, 2.0, math.inf, 0, [(4.9, 5.1, 0, 3)], 1, 4, 1, None) == 1  # its timing unknown: both ways
    assert room(4, 1, 0.19, 0.21, 0, [(1.9, 2.1, 0, 5)], 1, 4, 1, None) == 4  # one out of its window already: no bound
    # two open grants that may each come first: a (version 0, window 4) and b (version 1), admitted as one that
    # may overtake a (a's slack 2 went to it). A third that may overtake a has no slack left: a's window is
    # full counting b, though b is expected after a (counting only the expected order gave it 2: a came stale)
    assert room(4, 1, 0.5, 1.2, 0, [(0.0, 1.0, 0, 2), (0.5, 0.9, 1, 2)], 1, 4, 1, None) == 0
    assert room(4, 1, 1.0, 1.2, 0, [(0.0, 1.0, 0, 2), (0.5, 0.9, 1, 2)], 1, 4, 1, None) == 4  # it comes after a
    # the trainer's demand bounds everything in flight
    assert room(4, 0, 0.7, 1.3, 2, [(0.3, 0.5, 0, 1)], 0, 4, 3, 5) == 2
    # a late grant may come any moment: before anything granted now
    late = Grant("w", 4, 4, 0, 1.0, granted=0.0, lo=0.5, hi=1.5, deadline=9.0)
    assert late.when(1.0) == (0.5, 1.5) and late.when(2.0) == (2.0, 2.0)



def test_the_indexed_pass_grants_exactly_what_room_does():
    """Flight (one pass's open grants indexed, O(log grants) a request) against room() itself, over random
    states: open grants of every timing (late ones, unknown round times), versions in and out of their
    windows, buffers and demands, and requests whose worker holds an open grant (those index the others afresh).
    Each answer equal."""
    rng = random.Random(2412)
    for trial in range(400):
        p, now = Pacer(max_staleness=rng.choice([0, 1, 3])), 100.0
        p.batch, p.held = rng.choice([4, 8, 16]), int(rng.random() < 0.5)
        p.demand = rng.choice([None, rng.randrange(0, 200)])
        latest = rng.randrange(0, 6)
        for i in range(rng.randrange(0, 40)):
            known = rng.random() < 0.8
            if known:  # times in binary fractions: expected arrivals tie exactly, as the bounds' < and > must handle
                p.round_s[f"w{i}"] = (rng.randrange(1, 40) / 2, rng.randrange(0, 12) / 4)
            if rng.random() < 0.6:
                p.grant(f"w{i}", rng.randrange(1, 9), max(0, latest - rng.randrange(0, 3)), now - rng.randrange(0, 60) / 2)
        buffered, pending = rng.randrange(0, 3 * p.batch), rng.choice([0, 0, latest + 1])
        flight = p.flight(latest, buffered, now, pending)
        for i in range(45):
            key, n = f"w{i}", rng.randrange(1, 9)
            assert p.room(key, n, latest, buffered, now, flight, pending) == p.room(key, n, latest, buffered, now, None, pending), (trial, key)
    # a bound's tie, exactly: an older grant expected until t = 1 exactly and a request expected from 1 on does
    # not push that grant (whose window is full: pushed, it would leave no room)
    p = Pacer(max_staleness=1)
    p.batch, p.round_s["a"], p.round_s["new"] = 4, (0.5, 0.125), (2.0, 0.0)  # a: 0..1 (0.5 -+ 0.5); new: 1..3
    p.grant("a", 4, 0, 0.0)
    assert p.room("new", 4, 1, 0, 0.0, p.flight(1, 0, 0.0)) == p.room("new", 4, 1, 0, 0.0) == 4



def test_a_grant_added_to_the_pass_index_leaves_it_as_a_rebuild_would():
    """Waiting.pace adds each grant it makes to its pass's index (Flight.add) instead of rebuilding it: over random
    states and grants of every timing, the index after each add answers every request as a fresh one does, and
    holds the same totals."""
    def read(f):  # what room() reads of an index, at every bound a request can fall between (ties in any order)
        at = f.lo + f.hi + [math.inf]
        return (f.total, f.keys, sorted(f.lo), sorted(f.hi), {x: f.left_before[bisect.bisect_left(f.lo, x)] for x in at},
                {x: f.min_slack_after[bisect.bisect_right(f.hi, x)] for x in at})
    rng = random.Random(1206)
    for trial in range(300):
        p, now = Pacer(max_staleness=rng.choice([0, 1, 3])), 100.0
        p.batch, p.held = rng.choice([4, 8, 16]), int(rng.random() < 0.5)
        p.demand = rng.choice([None, rng.randrange(0, 400)])
        latest = rng.randrange(0, 6)
        for i in range(60):
            if rng.random() < 0.8:
                p.round_s[f"w{i}"] = (rng.randrange(1, 40) / 2, rng.randrange(0, 12) / 4)
            if i < 30 and rng.random() < 0.6:
                p.grant(f"w{i}", rng.randrange(1, 9), max(0, latest - rng.randrange(0, 3)), now - rng.randrange(0, 60) / 2)
        buffered = rng.randrange(0, 3 * p.batch)
        flight = p.flight(latest, buffered, now)
        for i in range(30, 60):  # workers with no open grant: the adds a pass makes
            key, n = f"w{i}", rng.randrange(1, 9)
            k = p.room(key, n, latest, buffered, now, flight) if rng.random() < 0.8 else n  # sometimes past the room
            if k <= 0:
                continue
            g = p.grant(key, k, max(0, latest - rng.randrange(0, 2)), now)
            flight.add(*g.when(now), g.version, g.left, g.key)
            fresh = p.flight(latest, buffered, now)
            assert read(flight) == read(fresh), (trial, key)
            for j in range(60, 66):
                assert p.room(f"w{j}", 8, latest, buffered, now, flight) == p.room(f"w{j}", 8, latest, buffered, now, fresh)

def test_a_worker_whose_rounds_vary_is_not_taken_for_late():
    """The margin on a round's arrival follows how much the worker's rounds vary (RFC 6298's mean deviation),
    so a slow worker whose rounds take 0.25-0.75 s is still expected while it generates, not pushed out of its
    window by grants made after its predicted end. A steady worker keeps the --pace-jitter margin."""
    p = Pacer(max_staleness=1)
    p.jitter = 0.3
    assert measure(None, 0.26) == (0.26, 0.065)        # one round: the spread is unknown, a quarter of it
    rounds = [0.26, 0.7, 0.3, 0.75, 0.4, 0.65]
    state = None
    for x in rounds:
        state = measure(state, x)
    r, d = state
    lo, hi = p.expected_at(0.0, r, d)
    assert hi >= max(rounds) and lo <= min(rounds)      # every round it took falls inside its margin
    assert p.expected_at(0.0, r, 0.0) == pytest.approx((0.7 * r, 1.3 * r))  # no spread: jitter x r
    # what the proxy does with it: a grant expected on this worker's old 0.26 s, 0.3 s margin
    g = p.grant("slow", 2, 1, now=0.0)
    assert g.round_s is None and g.hi == math.inf       # no round measured yet: before and after everything
    p.round_s["slow"] = state
    g = p.grant("slow", 2, 1, now=10.0)
    assert g.when(10.0 + max(rounds)) == (g.lo, g.hi)   # its slowest round's time: still expected, not late
    assert g.record()["dev_s"] == d and g.deadline >= g.hi


def test_a_first_round_gets_the_margin_the_fleets_rounds_measured():
    """A worker measured once gets the fleet's spread of rounds around their expected time, not a fixed quarter:
    in a fleet whose rounds land within 10% of what was expected, a new worker's 2 s round is expected for
    2 s -+ 0.8 s (4 deviations), not -+ 2 s, so a grant made after it 1 s later no longer counts as pushing it.
    A fleet whose rounds scatter more gets more (up to twice the quarter), and too few rounds: the quarter."""
    p = Pacer(max_staleness=1)
    p.jitter = 0.3
    t = 0.0

    def one_round(key: str, x: float) -> None:
        nonlocal t
        p.grant(key, 1, 0, now=t)
        t += x
        p.arrived(key, now=t)

    for i in range(p.spread.MIN - 1):  # fewer rounds measured than MIN: the quarter
        one_round(f"w{i}", 1.0)
        one_round(f"w{i}", 1.1 if i % 2 else 0.9)
    one_round("new", 2.0)
    assert p.round_s["new"] == (2.0, pytest.approx(0.5))
    one_round("w0", 0.9)  # the MIN-th: |0.9 - r| / r, where w0's r is 1.0 smoothed with 0.9
    assert p.spread.first() == pytest.approx(0.1, abs=0.01)
    one_round("new2", 2.0)
    r, d = p.round_s["new2"]
    assert (r, d) == (2.0, pytest.approx(0.2, abs=0.02))
    lo, hi = p.expected_at(0.0, r, d)
    assert (lo, hi) == (pytest.approx(1.2, abs=0.1), pytest.approx(2.8, abs=0.1))  # a quarter: (0.0, 4.0)
    for i in range(300):  # rounds twice or half what was expected: capped at twice the quarter
        one_round("w1", 4.0 if i % 2 else 1.0)
    assert p.spread.first() == 0.5


def test_short_room_goes_to_the_fastest_worker():
    """Two workers wait, the slow one (8 s rounds) asked first; the window has room for one round of 4: the fast
    one (1 s rounds) gets it."""
    p = Pacer(max_staleness=1)
    p.batch, p.round_s["slow"], p.round_s["fast"] = 4, (8.0, 0.0), (1.0, 0.0)

    async def both() -> dict:
        w = Waiting()
        tasks = {}
        for key in ("slow", "fast"):
            tasks[key] = asyncio.create_task(w.wait(key, 4, 0.2, lambda: None))
            await asyncio.sleep(0)  # it is waiting before the next asks
        w.pace(p, latest=0, buffered=4, done=False, pending_version=0, now=0.0)  # window 8, 4 buffered: one round
        return {key: g.n if (g := await t) else 0 for key, t in tasks.items()}

    assert asyncio.run(both()) == {"slow": 0, "fast": 4}
    p.grants.clear()
    p.round_s["slow"] = (0.5, 0.0)  # measured faster now: it goes first
    assert asyncio.run(both()) == {"slow": 4, "fast": 0}


def test_a_worker_back_from_a_crash_is_tried_before_the_others_its_old_grant_shuts_out():
    """A worker crashed mid-round and asks again; its old grant (version 0, fills version 0's window: every new
    grant would push it out) still holds its place. 33 faster workers wait too: more than a pass tries that do
    not fit. It goes first, its new grant closes the old one, and the window opens again."""
    p = Pacer(max_staleness=1)
    p.batch, p.round_s["back"] = 4, (5.0, 0.0)
    p.grant("back", 4, 0, now=0.0)  # version 0's window: (1 - 1 + 0 + 1) x 4 = 4 groups, all its own
    fast = [f"fast-{i}" for i in range(Waiting.MISSES + 1)]
    for key in fast:
        p.round_s[key] = (1.0, 0.0)

    async def all_ask() -> dict:
        w = Waiting()
        tasks = {key: asyncio.create_task(w.wait(key, 4, 0.2, lambda: None)) for key in fast + ["back"]}
        await asyncio.sleep(0)
        w.pace(p, latest=1, buffered=0, done=False, pending_version=0, now=1.0)
        return {key: g.n for key, t in tasks.items() if (g := await t)}

    got = asyncio.run(all_ask())
    assert got.pop("back") == 4 and p.grants["back"].version == 1   # the old grant closed, a new one at version 1
    assert sum(got.values()) == 4                                   # version 1's window: 8, one fast round beside it


def test_a_worker_with_no_poll_open_is_taken_for_gone_after_the_grace_unless_it_polls_again():
    """The version long-poll is a worker's sign of life: its last poll ended (its connection closed unanswered: a
    dead process; or answered, and the worker died before its next one), with no new poll within poll_grace_s,
    takes the worker for gone, and its grant no longer covers the trainer's demand (others are granted it); a
    poll within the grace keeps it."""
    p = Pacer(max_staleness=5)
    p.poll_grace_s, p.batch, p.demand = 5.0, 4, 16
    for key in ("dead", "blip", "answered", "silent"):
        p.grant(key, 4, 0, now=0.0, round_s=10.0, dev_s=0.0)   # deadline: grant_s after 3 rounds, t = 60
    for key in ("dead", "blip", "answered"):
        p.polling(key)
    p.polling("blip")                                           # two polls open: one ending is no sign
    p.polled("blip", 1.0)
    p.polled("dead", 1.0)
    p.polled("answered", 1.0)
    p.polling("answered")                                       # answered, and it polls again (as rollout.py)
    p.polling("stranger")                                       # no grant: an ended poll leaves nothing behind
    p.polled("stranger", 1.0)
    assert set(p.dropped) == {"dead"} and "stranger" not in p.polls and "silent" not in p.polls
    assert p.expire(5.9) == [] and p.open_demand() == 16        # within the grace
    p.polled("blip", 2.0)                                       # its last open poll ended too ...
    p.polling("blip")                                           # ... and it came back at once (a network blip)
    p.polled("answered", 2.0)                                   # answered again, and no next poll: it died
    assert p.expire(6.0) == [] and len(p.grants) == 4           # it keeps its place in the window ...
    assert [k for k, g in p.grants.items() if g.gone] == ["dead"] and p.stats()["groups_gone"] == 4
    assert p.open_demand() == 20 and p.open_demand("dead") == 16   # ... not the demand (but for its own request)
    assert p.expire(7.0) == [] and [k for k, g in p.grants.items() if g.gone] == ["dead", "answered"]
    assert p.open_demand() == 24 and p.stats()["groups_gone"] == 8
    # a new worker: 16 groups in flight cover the demand of 16, but 8 of them will not come
    assert p.room("new", 8, latest=0, buffered=0, now=7.0) == 8
    assert p.room("new", 8, latest=0, buffered=0, now=7.0, flight=p.flight(0, 0, 7.0)) == 8
    p.polling("answered")                                       # back after all (its poll was late): covers again
    assert p.open_demand() == 20 and [k for k, g in p.grants.items() if g.gone] == ["dead"]
    assert p.room("dead", 8, latest=0, buffered=0, now=7.0) == 4   # back after all: its new grant closes the old
    assert p.expire(59.0) == [] and not p.dropped
    assert {g.key for g in p.expire(60.0)} == {"dead", "blip", "answered", "silent"}   # the deadline, as before
    assert p.stats()["groups_expired"] == 16


def test_a_late_grant_is_backed_up_for_the_runs_last_batches_and_keeps_its_place_in_the_window():
    """When what the trainer will still lease is all in flight, a grant past its expected arrival no longer covers
    it: the rest goes to another worker as well (a backup round; whichever comes second is left over), so the
    trainer does not wait on a straggler or a worker that died unseen. It still holds its place in the staleness
    window, and its own worker's next request closes it, as before."""
    p = Pacer(max_staleness=1)
    p.jitter, p.batch, p.demand = 0.5, 8, 8                  # the trainer's last batch: 8 groups to go
    p.grant("slow", 8, 0, now=0.0, round_s=10.0, dev_s=1.0)  # expected between 5 and 15 s (a margin of 5)
    for now in (0.1, 14.9):                                 # on time: it covers the last batch
        assert p.open_demand(now=now) == 8
        assert p.room("fast", 8, latest=0, buffered=0, now=now) == 0
        assert p.room("fast", 8, latest=0, buffered=0, now=now, flight=p.flight(0, 0, now)) == 0
    assert p.open_demand(now=15.1) == 16 and p.open_demand("slow", 15.1) == 8
    assert p.room("fast", 8, latest=0, buffered=0, now=15.1) == 8   # late: granted again
    assert p.room("fast", 8, latest=0, buffered=0, now=15.1, flight=p.flight(0, 0, 15.1)) == 8
    p.backed_up(p.grant("fast", 8, 0, now=15.1, round_s=1.0, dev_s=0.1), buffered=0)
    assert p.stats()["groups_backed_up"] == 8                # one of the two copies will be left over
    assert p.room("other", 8, latest=0, buffered=0, now=15.2) == 0   # one backup, not one per request
    p.demand = None                                          # before the end: only the window binds (16 groups)
    assert p.room("other", 16, latest=0, buffered=0, now=15.2) == 0   # the late 8 and fast's 8 fill it
    assert p.room("other", 16, latest=0, buffered=0, now=15.2, flight=p.flight(0, 0, 15.2)) == 0


def test_a_dead_workers_grant_is_granted_again_within_the_grace_not_at_its_deadline(bucket, spawn):
    """Through the real proxy: the trainer's remaining demand is covered by the buffer and two workers'
    grants, and both workers long-poll for versions with their worker_id. One dies (its poll's connection
    closes); within --poll-grace-s and a pass, a waiting worker is granted its share. The live one's grant
    stays."""
    # (w1's round is measured in milliseconds: a wide margin keeps its grant from being late, and so backed up)
    p = spawn("--pace", "--max-staleness", "3", "--poll-grace-s", "1", "--grant-s", "300", "--pace-jitter", "500")
    lease(p, 4, left=12)
    assert len(ask(p, "w1")["indices"]) == 4 and deliver(p, "w1", 0, 4) == ["accepted"] * 4   # w1's round time
    assert len(ask(p, "w1")["indices"]) == 4 and len(ask(p, "w2")["indices"]) == 4   # the demand: 12 covered
    polls = {}
    for w in ("w1", "w2"):  # raw sockets: closing one is what the kernel does for a process that died
        s = socket.create_connection(("127.0.0.1", p.port))
        s.sendall(f"GET /v1/adapters/latest?after=0&wait_s=60&worker_id={w} HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {p.token}\r\n\r\n".encode())
        polls[w] = s
    time.sleep(0.5)
    assert ask(p, "w3", wait_s=0.3)["indices"] == []         # nothing more while both are alive
    polls["w1"].close()
    t0 = time.monotonic()
    got = ask(p, "w3", wait_s=15)
    assert len(got["indices"]) == 4 and time.monotonic() - t0 < 5   # grace 1 s + the housekeeping's second
    st = p.stats()["pacing"]
    assert st["groups_gone"] == 4 and st["groups_expired"] == 0 and st["open_grants"] == 3  # w1's until its deadline
    assert deliver(p, "w2", 0, 4) + deliver(p, "w3", 0, 4) == ["accepted"] * 8
    assert all(lease(p, 4, left=12 - 4 * i)["batch_id"] for i in range(3))
    assert p.stats()["groups_dropped_stale"] == 0
    polls["w2"].close()


def test_a_worker_that_dies_between_two_polls_is_taken_for_gone_and_rollouts_sync_polls_on(bucket, spawn, tmp_path,
                                                                                        monkeypatch):
    """w1's poll is answered by a new version and w1 never polls again (it died while downloading it); w2 is
    rollout.py's own AdapterSync, which downloads that version and keeps a poll open. Within --poll-grace-s and
    a pass, w3 is granted w1's share of the trainer's demand; w2's grant stays."""
    import proxy_client
    import rollout
    from safetensors.torch import save_file
    import torch
    # (w1's round is measured in milliseconds: a wide margin keeps its grant from being late, and so backed up; a
    # wide window lets w3's grant at version 1 pass w2's, which that margin has arriving any time)
    p = spawn("--pace", "--max-staleness", "5", "--poll-grace-s", "1", "--grant-s", "300", "--pace-jitter", "500")
    lease(p, 4, left=12)
    assert len(ask(p, "w1")["indices"]) == 4 and deliver(p, "w1", 0, 4) == ["accepted"] * 4   # w1's round time
    assert len(ask(p, "w1")["indices"]) == 4 and len(ask(p, "w2")["indices"]) == 4   # the demand: 12 covered
    s = socket.create_connection(("127.0.0.1", p.port))
    s.sendall(f"GET /v1/adapters/latest?after=0&wait_s=60&worker_id=w1 HTTP/1.1\r\nHost: x\r\n"
              f"Authorization: Bearer {p.token}\r\n\r\n".encode())
    monkeypatch.setattr(rollout.tempfile, "tempdir", str(tmp_path))
    sync = rollout.AdapterSync(proxy_client.ProxyClient(p.url, p.token), bucket, model="m", worker_id="w2", poll_s=60)
    sync.start()
    time.sleep(0.5)
    assert ask(p, "w3", wait_s=0.3)["indices"] == []         # nothing more while both are alive
    d = tmp_path / "v1"
    d.mkdir()
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.zeros(4, 8)}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    common.publish_adapter(bucket, str(d), 1, 1, "m")
    assert p.http.post("/v1/adapters", json={"version": 1, "step": 1, "published_at": time.time()}).status_code == 200
    t0 = time.monotonic()
    assert b'"version":1' in answer(s)                         # w1's poll answered; w1 polls no more
    got = ask(p, "w3", wait_s=15)
    assert len(got["indices"]) == 4 and time.monotonic() - t0 < 5   # grace 1 s + the housekeeping's second
    wait_for(lambda: sync.seen == 1, 30, msg="w2's sync thread to hold version 1")
    time.sleep(1.5)  # past the grace: w2 polls on, so its grant still covers the demand
    st = p.stats()["pacing"]
    assert st["groups_gone"] == 4 and st["groups_expired"] == 0 and st["open_grants"] == 3, st
    assert not sync.failed and sync.take()["version"] == 1
    sync.done = True
    s.close()


def test_a_worker_waits_until_its_round_can_be_trained_and_none_starts_after_the_last_batch(bucket, spawn):
    p = spawn("--pace", "--max-staleness", "1")
    assert lease(p, 4, left=12)["batch_id"] is None      # the trainer: batches of 4, three to go
    assert len(ask(p, "w1")["indices"]) == 4              # two rounds of version 0 fit in the window of 8
    assert deliver(p, "w1", 0, 4) == ["accepted"] * 4     # (a round that came back: a round time is known)
    assert len(ask(p, "w2")["indices"]) == 4
    t0 = time.monotonic()
    assert ask(p, "w3", wait_s=0.5) == {"indices": [], "epochs": [], "version": 0, "done": False, "retry_s": 1.0}
    assert time.monotonic() - t0 >= 0.45                  # it waited on the proxy, not on us
    first = lease(p, 4, left=12)
    assert first["batch_id"] and len(first["groups"]) == 4
    assert ask(p, "w3")["indices"] == []                  # the trainer holds a batch: version 0 fits 4, w2 has them

    # a worker waiting when the next version comes is granted at once, with that version
    waiting = Worker(lambda: (ask(p, "w3", wait_s=30), time.monotonic()))
    waiting.start()
    wait_for(lambda: p.stats()["waiting_for_grants"] == 1, 30, msg="w3 to wait for a grant")
    register(bucket, p, 1)
    t_reg = time.monotonic()
    got, t_got = waiting.join(30)
    assert len(got["indices"]) == 4 and got["version"] == 1 and t_got - t_reg < 5
    assert p.http.post(f"/v1/batches/{first['batch_id']}/ack").status_code == 200

    # demand: 8 groups to go, and w2's 4 and w3's 4 are in flight: nothing more, whatever the window says
    assert ask(p, "w4")["indices"] == []
    assert deliver(p, "w2", 0, 4) == ["accepted"] * 4 and deliver(p, "w3", 1, 4) == ["accepted"] * 4
    b2 = lease(p, 4, left=8)
    register(bucket, p, 2)
    assert ask(p, "w4")["indices"] == []
    b3 = lease(p, 4, left=4)                              # the last batch
    assert b2["batch_id"] and b3["batch_id"]
    assert ask(p, "w4", wait_s=0.3)["indices"] == []
    later = Worker(lambda: ask(p, "w4", wait_s=30))
    later.start()
    wait_for(lambda: p.stats()["waiting_for_grants"] == 1, 30, msg="w4 to wait for a grant")
    register(bucket, p, 3, final=True)
    assert later.join(30)["done"] is True                 # told at once that the run is over
    st = p.stats()
    assert st["groups_dropped_stale"] == 0 and st["buffer_size"] == 0
    assert st["pacing"]["groups_granted"] == st["groups_leased"] == 12   # every round granted was trained
    assert ask(p, "w5")["done"] is True


def test_a_trainer_restarted_while_holding_a_batch_does_not_stall_the_workers(bucket, spawn):
    """At max_staleness 0 nothing may start while the trainer trains (the round would arrive one version old);
    a trainer that died holding its batch never registers the next version: its successor's lease request
    says it is waiting, and the workers are granted again."""
    p = spawn("--pace", "--max-staleness", "0", "--lease-s", "300")
    lease(p, 4, left=40)
    assert len(ask(p, "w1")["indices"]) == 4 and ask(p, "w2")["indices"] == []
    deliver(p, "w1", 0, 4)
    assert lease(p, 4, left=40)["batch_id"]               # ... and dies with it
    assert ask(p, "w1", wait_s=0.3)["indices"] == []      # it trains: nothing of version 0 could be used after it
    assert lease(p, 4, left=40)["batch_id"] is None       # the restarted trainer asks for a batch
    assert len(ask(p, "w1")["indices"]) == 4              # version 0 is again what the next batch is trained from
    assert p.stats()["groups_dropped_stale"] == 0


def test_a_batch_asked_for_while_the_trainer_trains_counts_from_the_version_before_it(bucket, spawn):
    """train.py's prefetch: the next batch asked for with after_version (the version the trainer registers
    before it trains it). The staleness filter, the histogram and pacing count from that version; so does a
    restarted proxy."""
    p = spawn("--pace", "--max-staleness", "1", "--lease-s", "300")

    def unpaced(k: int, version: int) -> None:  # a worker that asks for prompts without wait_s: never held back
        p.http.post("/v1/prompts/lease", json={"dataset": "d", "size": 1000, "n": k, "worker_id": "u"})
        deliver(p, "u", version, k)

    lease(p, 4, left=16)
    assert len(ask(p, "w1")["indices"]) == 4
    deliver(p, "w1", 0, 4)
    first = lease(p, 4, left=16)
    assert first["batch_id"] and p.stats()["pacing"]["trainer_batches_held"] == 1
    r = p.http.post("/v1/batches/lease", json={"num_groups": 4, "after_version": 2})
    assert r.status_code == 409 and "after_version 2" in r.text and "latest registered version 0" in r.text

    # the second batch, asked for while the first trains: trained from version 1, so two batches are held whose
    # versions are not registered, and a round of version 0 (trained from version 2 at best) is not granted
    unpaced(4, 0)
    second = p.http.post("/v1/batches/lease", json={"num_groups": 4, "groups_left": 12, "after_version": 1}).json()
    assert second["batch_id"] and second["latest_version"] == 0
    assert p.stats()["pacing"]["trainer_batches_held"] == 2
    assert ask(p, "w2", wait_s=0.2)["indices"] == []
    os.kill(p.proc.pid, signal.SIGKILL)                     # a restart counts the same from the journal
    p.proc.wait()
    p = spawn("--pace", "--max-staleness", "1", "--lease-s", "300")
    assert p.stats()["pacing"]["trainer_batches_held"] == 2
    register(bucket, p, 1)
    assert p.http.post(f"/v1/batches/{first['batch_id']}/ack").status_code == 200
    assert p.stats()["pacing"]["trainer_batches_held"] == 1

    # the third, asked for while the second trains (after version 2): a round of version 0 is too stale for it,
    # so it is passed over, not dropped (version 2 may yet fail to register) ...
    unpaced(4, 0)
    ahead = {"num_groups": 4, "groups_left": 8, "after_version": 2}
    assert p.http.post("/v1/batches/lease", json={**ahead, "wait_s": 0.3}).json()["batch_id"] is None
    assert p.stats()["groups_dropped_stale"] == 0 and p.stats()["buffer_size"] == 4
    # ... and dropped when version 2 comes; a round of version 2 answers the request waiting (whether it came
    # before the registration or after, it is trained from version 2)
    waiting = Worker(lambda: p.http.post("/v1/batches/lease", json={**ahead, "wait_s": 30}).json())
    waiting.start()
    register(bucket, p, 2)
    assert p.stats()["groups_dropped_stale"] == 4
    assert p.http.post(f"/v1/batches/{second['batch_id']}/ack").status_code == 200
    assert len(ask(p, "w1")["indices"]) == 4
    deliver(p, "w1", 2, 4)
    third = waiting.join(30)
    assert [g["policy_version"] for g in third["groups"]] == [2] * 4 and third["latest_version"] == 2
    assert p.stats()["pacing"]["trainer_batches_held"] == 1
    # staleness counted from the version each batch is trained from: the second's groups were one version old
    assert p.stats()["staleness_hist"] == {"0": 8, "1": 4}


def test_a_batch_asked_for_ahead_and_released_goes_back_at_once(bucket, spawn):
    """A trainer that stops with its next batch asked for ahead releases it (train.py): its groups are leasable
    again at once, in their order, also after a proxy restart; the lease is closed for good."""
    p = spawn("--lease-s", "300")
    deliver(p, "w1", 0, 4)
    got = lease(p, 4, left=None)
    assert got["batch_id"] and p.stats()["buffer_size"] == 0
    r = p.http.post(f"/v1/batches/{got['batch_id']}/release")
    assert r.status_code == 200 and r.json() == {"released": 4}
    assert p.stats()["buffer_size"] == 4
    for route in ("ack", "renew", "release"):
        assert p.http.post(f"/v1/batches/{got['batch_id']}/{route}").status_code == 410
    assert p.http.post("/v1/batches/0123456789abcdef/release").status_code == 404
    deliver(p, "w1", 0, 1)  # its commit comes after the release's in the journal
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()
    p = spawn("--lease-s", "300")
    again = lease(p, 5, left=None)
    assert [g["group_id"] for g in again["groups"][:4]] == [g["group_id"] for g in got["groups"]]


def test_a_grant_holds_its_place_across_a_proxy_restart(bucket, spawn):
    p = spawn("--pace", "--max-staleness", "1")
    lease(p, 4, left=8)
    assert len(ask(p, "w1")["indices"]) == 4 and len(ask(p, "w2")["indices"]) == 4   # the demand: 8 in flight
    deliver(p, "w1", 0, 2)                                # half of w1's round is in
    before = p.http.get("/v1/state").json()["pacing"]
    assert before["grants"] == [["w1", 4, 2, 0, None, None], ["w2", 4, 4, 0, None, None]]
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()
    q = spawn("--pace", "--max-staleness", "1")
    assert q.http.get("/v1/state").json()["pacing"] == before
    assert ask(q, "w3")["indices"] == []                  # the 6 groups still out hold their places
    assert deliver(q, "w1", 0, 2) + deliver(q, "w2", 0, 4) == ["accepted"] * 6
    assert lease(q, 4, left=8)["batch_id"] and lease(q, 4, left=4)["batch_id"]
    st = q.stats()
    assert st["pacing"]["open_grants"] == 0 and st["groups_dropped_stale"] == 0

    # what the live proxy holds is what a replay of its journal holds
    live = q.http.get("/v1/state").json()["pacing"]
    os.kill(q.proc.pid, signal.SIGKILL)
    q.proc.wait()
    replay = Ledger(max_staleness=1, lease_s=300.0)
    for key, blob in journal.read_objects(bucket, journal.log_keys(bucket)):
        replay.apply_object(key, blob)
    assert replay.pacing.book_state() == live and live["counts"]["groups_granted"] == 8


def test_a_grant_is_answered_after_one_journal_commit(bucket, spawn):
    """The cursor, the grant and the prompt lease (whom the prompts went to) share one commit: the worker's answer
    waits for one bucket write, not two in a row, so its round starts sooner."""
    p = spawn("--pace", "--max-staleness", "1")
    lease(p, 4, left=8)
    before = set(journal.log_keys(bucket))
    got = ask(p, "w1")
    assert len(got["indices"]) == 4
    commits = [[json.loads(line) for line in blob.splitlines()[1:]]
               for key, blob in journal.read_objects(bucket, [k for k in journal.log_keys(bucket) if k not in before])]
    mine = [c for c in commits if any(r.get("t") == "grant" for r in c)]
    assert len(mine) == 1, commits
    kinds = [r.get("t") for r in mine[0] if r.get("t") in ("cursor", "grant", "prompts")]
    assert kinds == ["cursor", "grant", "prompts"], mine[0]
    assert next(r for r in mine[0] if r.get("t") == "prompts")["lease_id"] == got["lease_id"]


def test_joins_leaves_a_crash_and_a_trainer_restart_lose_no_round(bucket, spawn, seed):
    """Workers of different speeds, one joining late, one leaving, one crashing with a grant; the trainer
    restarted mid-run. Nothing deadlocks, every round delivered is trained (none refused as stale, none left
    over) but for the second copies of backed-up rounds (late ones near the end), and nothing is granted past
    the trainer's last batch."""
    rng = random.Random(seed)
    steps, B = 10, 4
    p = spawn("--pace", "--max-staleness", "1", "--grant-s", "2", "--lease-s", "300")
    latest, done, answers, delivered = [0], threading.Event(), [], [0]
    lock = threading.Lock()

    def worker(name: str, speed: float, start_after: float, rounds: int, crash: bool) -> None:
        time.sleep(start_after)
        r = random.Random(f"{seed}:{name}")
        for i in range(rounds):
            while not done.is_set():
                got = ask(p, name, n=r.choice([2, 4]), wait_s=1.0)
                if got["done"]:
                    return
                if got["indices"]:
                    break
            else:
                return
            if crash:  # took its grant and died: the grant must give its place up (--grant-s 2)
                return
            time.sleep(speed * r.uniform(0.5, 1.5))
            statuses = deliver(p, name, got["version"], len(got["indices"]))
            with lock:
                answers.extend(statuses)
                delivered[0] += len(statuses)

    def trainer() -> None:
        step = 1
        while step <= steps:
            got = lease(p, B, left=(steps - step + 1) * B, wait_s=2.0)
            if not got["batch_id"]:
                continue
            if step == steps // 2 and not restarted:  # dies holding it; its successor redoes this step
                restarted.append(got["batch_id"])
                continue
            assert all(got["latest_version"] - g["policy_version"] <= 1 for g in got["groups"])
            time.sleep(rng.uniform(0.1, 0.4))
            register(bucket, p, latest[0] + 1, final=step == steps)
            latest[0] += 1
            assert p.http.post(f"/v1/batches/{got['batch_id']}/ack").status_code == 200
            step += 1
        done.set()

    restarted: list[str] = []
    threads = [Worker(worker, "fast", 0.1, 0.0, 100, False), Worker(worker, "slow", 0.5, 0.0, 100, False),
               Worker(worker, "late", 0.2, 1.5, 100, False), Worker(worker, "leaves", 0.2, 0.0, 2, False),
               Worker(worker, "crashes", 0.2, 0.3, 1, True), Worker(trainer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    st = p.stats()
    assert restarted and p.http.get("/v1/adapters/latest").json()["done"]
    assert set(answers) <= {"accepted", "stale"} and len(answers) == delivered[0], st
    # every group delivered was leased (the dead trainer's batch included); what was not, dropped as stale (refused
    # at its submission, or accepted and dropped from the buffer once the versions moved past it) or left over in the
    # buffer, is at most the groups granted as backups (one of two copies is left over)
    spare = st["groups_dropped_stale"] + st["buffer_size"]
    assert st["groups_leased"] == (steps + 1) * B == delivered[0] - spare, json.dumps(st)
    assert spare <= st["pacing"]["groups_backed_up"] and answers.count("stale") <= st["groups_dropped_stale"], st
    # the dead worker's grant may outlive the run (its round was backed up once late): it runs out at its deadline
    wait_for(lambda: p.stats()["pacing"]["open_grants"] == 0, 15, msg="the dead worker's grant to run out")
