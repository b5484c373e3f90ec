"""Autoscaling the rollout jobs (lib/jobs/autoscale.py) from the real proxy's signals (lib/proxy/fleet.py): the
trainer's idle time and the workers' waits for grants as the proxy measures them, the policy's bounds (budget cap,
cool-downs, lent workers), scale-down through the proxy with nothing lost, and the supervisor applying decisions on
emulated Jobs (tests/support/jobs_emulator.py, below huggingface_hub as in test_supervisor.py), restarted mid-decision.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from huggingface_hub import HfApi

import proxy_client
from autoscale import (STATE, Bounds, Decision, Signals, Window, affordable, apply, check_budget, decide, fixed_cost,
                       initial_state, memory_of, signals)
from hf_jobs import JobSpec, save_launch
from jobs_emulator import JobsEmulator
from proxyproc import Worker, spawn, wait_for  # noqa: F401 - spawn is a fixture
from supervisor import Policy, Supervisor
from test_pacing import ask, deliver, lease, register

TOKENS = {"HF_TOKEN": "hf_FAKEtoken0123456789"}


def granted(p, worker: str) -> list[int]:
    """A grant expected at once: asked with a wait all the same, as a pass of pacing may come a moment later (a pass
    begins no sooner than ten times its predecessor's duration after it: proxy.PACE_SHARE)."""
    return ask(p, worker, wait_s=5.0)["indices"]


def sig(util: float, wait: float, own: int = 1, lent: int = 0) -> Signals:
    return Signals(window_s=60.0, trainer_util=util, wait_share=wait, own_workers=own, lent_workers=lent, buffer=0,
                   step_s=5.0, round_s=8.0)


def judged(s: Signals, *args, **kw) -> Decision:
    """decide() on the first look whose window since the last change holds judge_steps steps, `s` for both windows."""
    return decide(s, *args, judge=s, **kw)


# ---- the policy ----------------------------------------------------------------------------------------------


def test_the_budget_cap_bounds_the_fleet_at_the_flavors_prices():
    """Proxy on cpu-upgrade with its exposed port, trainer on a10g-small, supervisor on cpu-basic: $1.05/hour before
    any worker; each l4x1 worker $0.80 (costs.PRICES). $3.00/hour leaves room for 2 workers, $5.00 for 4."""
    specs = [JobSpec("proxy", "proxy.py", [], [], "cpu-upgrade", [], {}), JobSpec("trainer", "train.py", [], [], "a10g-small", [], {}),
             JobSpec("supervisor", "supervisor.py", [], [], "cpu-basic", [], {}),
             JobSpec("rollout-1", "rollout.py", [], ["--worker-id", "r-w1"], "l4x1", [], {})]
    fixed, price = fixed_cost(specs)
    assert (round(fixed, 2), price) == (1.05, 0.80)
    assert affordable(Bounds(max_workers=8, budget_per_hour=3.0), fixed, price) == 2
    assert affordable(Bounds(max_workers=8, budget_per_hour=5.0), fixed, price) == 4
    assert affordable(Bounds(max_workers=3, budget_per_hour=5.0), fixed, price) == 3   # max_workers binds first
    # the trainer starved, but the cap is reached: hold; over it (a cap lowered by a relaunch): down to it
    capped = decide(sig(0.3, 0.0), fleet=2, starting=0, bounds=Bounds(max_workers=8), most=2, since_change_s=math.inf)
    assert (capped.action, capped.why) == ("hold", "at_bounds")
    over = decide(sig(0.3, 0.0), fleet=4, starting=0, bounds=Bounds(max_workers=8), most=2, since_change_s=0.0)
    assert (over.action, over.n, over.why) == ("down", 2, "over_bounds")
    with pytest.raises(SystemExit, match=r"no price for flavor\(s\) gpu-of-the-future"):
        fixed_cost([*specs[:3], JobSpec("rollout-1", "rollout.py", [], [], "gpu-of-the-future", [], {})])
    with pytest.raises(SystemExit, match=r"budget_per_hour \$1.5 does not pay for the run's other jobs \(\$1.05/hour\) "
                                         r"and 1 worker\(s\) at \$0.80/hour: raise it to at least \$1.85"):
        check_budget(Bounds(budget_per_hour=1.5), specs)
    check_budget(Bounds(budget_per_hour=1.85), specs)
    with pytest.raises(ValueError, match="max_workers 0: at least min_workers and 1"):
        Bounds(max_workers=0)


def test_cool_downs_hold_changes_and_lent_workers_are_free_capacity():
    b = Bounds(up_cooldown_s=300, down_cooldown_s=600, max_step=3)
    starved = sig(0.4, 0.0)
    assert decide(starved, 1, 0, b, 4, since_change_s=299).why == "cooling_down"
    up = decide(starved, 1, 0, b, 4, since_change_s=301)
    # one worker keeps the trainer busy 0.4: about 0.85 / 0.4 = 2.1 workers' worth reach the target, so 2 more
    assert (up.action, up.n, up.why) == ("up", 2, "trainer_waits") and up.signals["trainer_util"] == 0.4
    # the same utilisation with three participants' workers live: they are already part of the fleet it measures
    assert decide(sig(0.4, 0.0, own=1, lent=3), 1, 0, b, 4, math.inf).n == 3 - 0   # 4 x 2.1 = 9 -> 9 - 3 - 1, max_step 3
    assert decide(sig(0.9, 0.0, own=1, lent=3), 1, 0, b, 4, math.inf).action == "hold"   # at target thanks to them
    waiting = sig(0.95, 0.7, own=3)
    assert decide(waiting, 3, 0, b, 4, since_change_s=599).why == "cooling_down"
    down = decide(waiting, 3, 0, b, 4, since_change_s=601)
    assert (down.action, down.n, down.why) == ("down", 1, "workers_wait")
    assert decide(waiting, 1, 0, b, 4, math.inf).action == "hold"    # never below min_workers
    # up again after a down waits out the down cool-down (against flapping where no fleet size reaches the target)
    assert decide(starved, 2, 0, b, 4, since_change_s=400, last_change="down").why == "cooling_down"
    assert decide(starved, 2, 0, b, 4, since_change_s=400, last_change="up").action == "up"
    assert decide(starved, 2, 1, b, 4, math.inf).why == "starting"    # a launch not running yet: wait for it


def reading(clock: float, idle: float, acked: int, leased: int | None = None, waited: float = 0.0,
            incarnation: int = 1) -> dict:
    """A /v1/stats answer as the proxy gives it, with only what signals() reads (one live worker of the run's):
    `acked` steps done, each a version registered."""
    return {"incarnation": incarnation, "batches_leased": acked + 1 if leased is None else leased,
            "latest_version": acked, "live_workers": {"admin": 1}, "buffer_size": 0, "pacing": {},
            "fleet": {"clock_s": clock, "trainer_idle_s": idle, "grant_wait_s": waited}}


def test_a_window_holds_trainer_steps_and_starts_once_the_trainer_has_its_first_batch():
    """A window shorter than a step reads 0 or 1 by where the step's wait falls, and the wait for the first batch is
    start-up: the window starts at the first reading after a batch was leased and ends once it holds
    min_window_steps steps (and min_window_s); a change starts it over."""
    w = Window.of(Bounds(min_window_s=5.0, min_window_steps=3))
    assert w.read(reading(0.0, 0.0, acked=0, leased=0)) is None
    assert w.read(reading(20.0, 20.0, acked=0, leased=1)) is None   # 20 s waiting for the first batch: not counted
    assert w.read(reading(30.0, 24.0, acked=2)) is None              # 10 s, but 2 steps
    got = w.read(reading(40.0, 26.0, acked=3))
    assert (got.window_s, got.steps, round(got.trainer_util, 3)) == (20.0, 3, 0.7)   # idle 6 s of 20: not 20 of 40
    assert w.read(reading(43.0, 26.0, acked=7)) is None              # 4 steps, but 3 s < min_window_s
    assert w.read(reading(52.0, 26.0, acked=9)).trainer_util == 1.0  # 12 s, 6 steps since the window read at 40 s
    w.start_over(reading(60.0, 30.0, acked=10))                      # the fleet changed at 60 s
    assert w.read(reading(70.0, 40.0, acked=12)) is None
    assert w.read(reading(80.0, 40.0, acked=13)).trainer_util == 0.5  # since the change: 10 s idle of 20
    assert w.read(reading(90.0, 40.0, acked=20, incarnation=2)) is None   # a new proxy: its sums start at 0
    assert signals(reading(0.0, 0.0, 0), reading(100.0, 0.0, 0), 1.0) is None   # no step in 100 s: no window


def test_a_change_is_judged_on_the_window_since_it_once_that_holds_judge_steps_steps():
    """Window.judge: the signals from the change (start_over) to now, None until they hold judge_steps steps and
    min_window_s; the short windows move on meanwhile; a new proxy starts it again at its first reading."""
    w = Window.of(Bounds(min_window_s=5.0, min_window_steps=2, judge_steps=6))
    w.start_over(reading(0.0, 0.0, acked=0))                          # the fleet changed at 0 s
    assert w.read(reading(10.0, 0.0, acked=2)).trainer_util == 1.0 and w.judge(reading(10.0, 0.0, acked=2)) is None
    assert w.read(reading(20.0, 10.0, acked=4)).trainer_util == 0.0 and w.judge(reading(20.0, 10.0, acked=4)) is None
    got = w.judge(reading(30.0, 12.0, acked=6))                       # 6 steps since the change: 12 s idle of 30
    assert (got.steps, got.window_s, round(got.trainer_util, 3)) == (6, 30.0, 0.6)
    assert w.judge(reading(40.0, 0.0, acked=2, incarnation=2)) is None   # a new proxy: the window starts again there
    assert w.judge(reading(60.0, 5.0, acked=8, incarnation=2)).trainer_util == 0.75


def test_an_added_worker_that_does_not_help_is_taken_back_and_its_size_not_tried_again():
    """The first window since an up is compared with the one that led to it: under target and less than min_gain
    busier, the added workers are taken back; that size is left alone for retry_s, whatever the next windows say.
    What the policy remembers is in the state written to the bucket, so a restarted supervisor remembers it."""
    b = Bounds(up_cooldown_s=30, down_cooldown_s=60, retry_s=600, min_gain=0.03)
    state = initial_state(["rollout-1", "rollout-2"])
    up = replace(decide(sig(0.6, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 0.0, b)), at=0.0)
    assert (up.action, up.n, up.why) == ("up", 1, "trainer_waits")
    state = json.loads(json.dumps(apply(state, up)))                 # as the supervisor writes and reads it
    assert memory_of(state, 10.0, b).before == ("up", 2, 0.6)
    # three workers: the trainer busy 0.61, 0.01 better, under min_gain: the third is taken back
    # until the window since the up holds judge_steps steps, the fleet holds and records no signals (apply keeps the
    # window before the change for the judgement)
    wait = decide(sig(0.2, 0.0, own=3), 3, 0, b, 4, memory=memory_of(state, 30.0, b))
    assert (wait.action, wait.why, wait.signals) == ("hold", "judging", {})
    assert memory_of(apply(state, wait), 30.0, b).before == ("up", 2, 0.6)
    back = replace(judged(sig(0.61, 0.2, own=3), 3, 0, b, 4, memory=memory_of(state, 40.0, b)), at=40.0)
    assert (back.action, back.n, back.why) == ("down", 1, "no_better")
    state = json.loads(json.dumps(apply(state, back)))
    assert state["fleet"] == ["rollout-1", "rollout-2"] and state["retired"] == {"rollout-3": 40.0}
    # back at two, the trainer still under target: three is not tried again within retry_s, then it is; unless the
    # trainer is now over min_gain less busy at two (0.57) than it was at three (0.61): things changed, try again
    assert decide(sig(0.6, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 639.0, b)).why == "tried"
    assert decide(sig(0.59, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 639.0, b)).why == "tried"
    assert decide(sig(0.57, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 639.0, b)).action == "up"
    again = decide(sig(0.6, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 641.0, b))
    assert (again.action, again.n) == ("up", 1)
    # an up that helped, though not to target (0.5 -> 0.7), stays; the comparison is made once, at the first window
    state = apply(initial_state(["rollout-1"]), replace(decide(sig(0.5, 0.0), 1, 0, b, 4), at=0.0))
    helped = judged(sig(0.7, 0.0, own=2), 2, 0, b, 4, memory=memory_of(state, 40.0, b))
    assert (helped.action, helped.why) == ("up", "trainer_waits")
    state = apply(state, replace(judged(sig(0.9, 0.0, own=2), 2, 0, b, 4, memory=memory_of(state, 20.0, b)), at=20.0))
    assert memory_of(state, 40.0, b).before is None
    assert decide(sig(0.5, 0.0, own=2), 2, 0, b, 4, memory=memory_of(state, 40.0, b)).why == "trainer_waits"
    # an up of two that did not help is taken back whole, and an up may not reach a size left
    two = apply(initial_state(["rollout-1"]), replace(decide(sig(0.2, 0.0), 1, 0, b, 4), at=0.0))
    assert len(two["fleet"]) == 3
    back2 = judged(sig(0.19, 0.0, own=3), 3, 0, b, 4, memory=memory_of(two, 40.0, b))
    assert (back2.action, back2.n, back2.why) == ("down", 2, "no_better")
    two = apply(two, replace(back2, at=40.0))
    capped = decide(sig(0.2, 0.0), 1, 0, b, 4, memory=memory_of(two, 200.0, b))
    assert (capped.action, capped.n) == ("up", 1)                    # wanted() says 5 in all; 3 was left: 2 at most


def test_workers_waiting_for_grants_scale_down_whatever_the_trainer_does():
    """Workers waiting for grants more than wait_share_down of their time are too many even while the trainer
    waits (staleness bounds it, not they): down by one after the down cool-down, never below min_workers, and that
    size is left alone for retry_s."""
    b = Bounds(up_cooldown_s=30, down_cooldown_s=60, retry_s=600, min_workers=1)
    state = apply(initial_state(["rollout-1", "rollout-2", "rollout-3"]),
                  Decision("up", 0, "trainer_waits", "", 3, at=0.0))   # a change at 0 s (the cool-downs' origin)
    both_wait = sig(0.4, 0.7, own=3)
    assert decide(both_wait, 3, 0, b, 4, memory=memory_of(state, 59.0, b)).why == "cooling_down"
    down = replace(decide(both_wait, 3, 0, b, 4, memory=memory_of(state, 61.0, b)), at=61.0)
    assert (down.action, down.n, down.why) == ("down", 1, "workers_wait")
    state = apply(state, down)
    first = replace(judged(sig(0.4, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 200.0, b)), at=200.0)
    assert first.why == "tried"                                      # no worse at two: three stays left
    state = apply(state, first)
    # later windows at two, however much less busy, do not bring three back within retry_s (needed judged it once)
    assert decide(sig(0.2, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 300.0, b)).why == "tried"
    assert decide(sig(0.4, 0.9, own=1), 1, 0, b, 4, memory=memory_of(state, 200.0, b)).action == "hold"   # min_workers
    # a busy trainer (0.95) whose workers wait 0.69 of their time: down; at two it waits (0.70, worse by more than
    # min_gain): the third is put back, and the workers waiting at three take none away within retry_s
    state = apply(initial_state(["rollout-1", "rollout-2", "rollout-3"]), Decision("up", 0, "x", "", 3, at=0.0))
    down = replace(decide(sig(0.95, 0.69, own=3), 3, 0, b, 4, memory=memory_of(state, 61.0, b)), at=61.0)
    state = apply(state, down)
    assert memory_of(state, 62.0, b).before == ("down", 3, 0.95)
    # the window since the down holds judge_steps steps only at 80 s; one of 0.70 at 70 s has the fleet hold
    assert decide(sig(0.70, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 70.0, b)).why == "judging"
    back = replace(judged(sig(0.70, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 80.0, b)), at=80.0)
    assert (back.action, back.n, back.why) == ("up", 1, "needed")
    state = apply(state, back)
    assert memory_of(state, 81.0, b).left == () and memory_of(state, 81.0, b).too_few == 3
    # the put-back is judged as well: a short window at three (0.72, the workers not waiting) has the fleet hold; the
    # window since it decides (busy 0.95), and the next up then needs a window of its own
    short = decide(sig(0.72, 0.1, own=3), 3, 0, b, 4, memory=memory_of(state, 120.0, b))
    assert (short.action, short.why, short.reason) == ("hold", "judging", "judging the last put-back on a window of "
                                                       f"{b.judge_steps} trainer steps since it")
    state = apply(state, replace(judged(sig(0.95, 0.1, own=3), 3, 0, b, 4, memory=memory_of(state, 130.0, b)), at=130.0))
    assert state["decisions"][-1]["why"] == "steady" and memory_of(state, 131.0, b).before is None
    assert decide(sig(0.95, 0.69, own=3), 3, 0, b, 4, memory=memory_of(state, 679.0, b)).why == "steady"
    assert decide(sig(0.95, 0.69, own=3), 3, 0, b, 4, memory=memory_of(state, 681.0, b)).why == "workers_wait"
    # the shortfall counts the fleet, not the proxy's live workers (one asked to leave is live until its round is in):
    # two workers at 0.72 want ceil(2 x 0.85 / 0.72) = 3, one more
    grow = decide(sig(0.72, 0.2, own=3), 2, 0, b, 4, memory=memory_of(initial_state(["rollout-1", "rollout-2"]), 0.0, b))
    assert (grow.action, grow.n) == ("up", 1)
    # a down after which the trainer is no worse (0.80 -> 0.79: the third worker did not help) stays down
    state = apply(initial_state(["rollout-1", "rollout-2", "rollout-3"]), Decision("up", 0, "x", "", 3, at=0.0))
    state = apply(state, replace(decide(sig(0.80, 0.6, own=3), 3, 0, b, 4, memory=memory_of(state, 61.0, b)), at=61.0))
    assert judged(sig(0.79, 0.1, own=2), 2, 0, b, 4, memory=memory_of(state, 80.0, b)).why == "tried"
    with pytest.raises(ValueError, match="min_window_steps 0: at least 1"):
        Bounds(min_window_steps=0)
    with pytest.raises(ValueError, match="judge_steps 2: at least min_window_steps"):
        Bounds(min_window_steps=3, judge_steps=2)


# ---- the proxy's signals ---------------------------------------------------------------------------------------


def fleet_of(p) -> dict:
    return p.stats()["fleet"]


def test_the_proxy_measures_the_trainers_idle_time_and_the_workers_waits(bucket, spawn):
    """The trainer is idle while a lease request of its is open with nothing to train: from the request when it holds
    nothing, from the registration of the version it was making when it asked ahead; a worker waits from its paced
    request to the answer. Read twice, around a step, that is a trainer starved of rollouts: decide() says up."""
    p = spawn("--pace", "--max-staleness", "1")
    assert lease(p, 4, left=40)["batch_id"] is None
    assert len(granted(p, "w1")) == 4 and deliver(p, "w1", 0, 4) == ["accepted"] * 4
    assert len(granted(p, "w2")) == 4
    t0 = time.monotonic()
    assert ask(p, "w3", wait_s=0.6)["indices"] == []          # the window is full: w3 waits on the proxy
    assert fleet_of(p)["grant_wait_s"] >= 0.55 and time.monotonic() - t0 >= 0.55
    first = lease(p, 4, left=40)["batch_id"]                  # the trainer gets w1's round at once
    assert first
    before = p.stats()                                        # a window starts once the trainer holds a batch
    idle0 = fleet_of(p)["trainer_idle_s"]
    # it asks ahead for its next batch while it makes version 1: not idle, however long that request waits
    r = p.http.post("/v1/batches/lease", json={"num_groups": 4, "wait_s": 1.0, "after_version": 1, "groups_left": 36})
    assert r.json()["batch_id"] is None and fleet_of(p)["trainer_idle_s"] - idle0 < 0.2
    # ... but once version 1 is registered during such a wait, the rest of the wait is idle
    waiting = Worker(lambda: p.http.post("/v1/batches/lease", json={"num_groups": 4, "wait_s": 2.0, "after_version": 1,
                                                                     "groups_left": 36}).json())
    waiting.start()
    time.sleep(0.5)
    register(bucket, p, 1)
    t_reg = time.monotonic()
    ack(p, first)                                             # the step is done: the window holds one
    assert waiting.join(30)["batch_id"] is None
    idle = fleet_of(p)["trainer_idle_s"] - idle0
    assert 0.2 < idle <= time.monotonic() - t_reg + 0.05, idle
    after = p.stats()
    got = signals(before, after, min_window_s=0.0)
    assert got is not None and got.trainer_util < 0.85 and got.own_workers == 3   # w1, w2, w3 asked: live
    assert decide(got, 1, 0, Bounds(), most=4, since_change_s=math.inf).action == "up"
    # another incarnation's reading, or a window too short, gives no signals
    assert signals({**before, "incarnation": 99}, after, 0.0) is None and signals(before, after, 3600.0) is None


def test_a_worker_asked_to_leave_sends_its_round_first_and_its_released_grant_is_counted(bucket, spawn):
    p = spawn("--pace", "--max-staleness", "1")
    assert lease(p, 4, left=40)["batch_id"] is None
    assert len(granted(p, "w1")) == 4
    told = p.http.post("/v1/workers/leave", json={"worker_id": "w1", "why": "scaled down by the supervisor"}).json()
    assert told == {"worker_id": "w1", "dismissed_requests": 0, "told": False}
    assert deliver(p, "w1", 0, 4) == ["accepted"] * 4        # its round, generated before it knew, is kept
    assert ask(p, "w1") == {"indices": [], "epochs": [], "version": 0, "done": False, "retry_s": 1.0,
                            "leave": "scaled down by the supervisor"}
    # a worker that asks again without sending its round (it crashed mid-round) gives back its grant: counted
    assert len(granted(p, "w2")) == 4
    assert p.http.post("/v1/workers/leave", json={"worker_id": "w2"}).is_success
    assert ask(p, "w2")["leave"] == "asked to leave" and fleet_of(p)["groups_released_at_leave"] == 4
    # a worker waiting for a grant when it is asked is answered at once, with no grant; then told
    assert len(granted(p, "filler")) == 4   # (the window is full: w3 waits)
    w3 = Worker(lambda: ask(p, "w3", wait_s=30))
    w3.start()
    wait_for(lambda: p.stats()["waiting_for_grants"] == 1, 30, msg="w3 to wait for a grant")
    assert p.http.post("/v1/workers/leave", json={"worker_id": "w3"}).json()["dismissed_requests"] == 1
    assert w3.join(10)["indices"] == [] and "leave" in ask(p, "w3")
    st = p.stats()
    assert st["fleet"]["told_to_leave"] == ["w1", "w2", "w3"] and st["workers"]["w1"]["groups"] == 4
    assert p.http.post("/v1/workers/leave", json={"worker_id": "bad id!"}).status_code == 422

    # a proxy without pacing tells a worker that names itself all the same
    q = spawn("--no-pace")
    assert q.http.post("/v1/workers/leave", json={"worker_id": "w9"}).is_success
    r = q.http.post("/v1/prompts/lease", json={"dataset": "d", "size": 1000, "n": 4, "worker_id": "w9"}).json()
    assert r["indices"] == [] and r["leave"] == "asked to leave"
    assert len(q.http.post("/v1/prompts/lease", json={"dataset": "d", "size": 1000, "n": 4}).json()["indices"]) == 4


@pytest.mark.timeout(300)
def test_rollout_py_asked_to_leave_finishes_its_round_and_exits_cleanly(tiny_model, start_proxy, bucket, run_name,
                                                                         tmp_path):
    from conftest import ROOT, stop
    from runlib import stand_in_trainer
    proxy = start_proxy("--group-size", "4")
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token,
           "SPOOL_DIR": str(tmp_path / "spool"), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--model", tiny_model, "--group-size", "4",
                               "--prompts-per-round", "1", "--max-new-tokens", "4", "--worker-id", "w1", "--poll-s", "1"],
                              env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        with stand_in_trainer(proxy):
            wait_for(lambda: " round 1 v0" in log.read_text() or worker.poll() is not None, 240, msg="a first round")
            assert proxy.http.post("/v1/workers/leave", json={"worker_id": "w1", "why": "scaled down"}).is_success
            assert worker.wait(timeout=120) == 0, log.read_text()[-2000:]
    finally:
        stop(worker)
    text = log.read_text()
    assert "leaving: the proxy asks this worker to (scaled down)" in text and "Traceback" not in text
    sent = sum(st == "accepted" for x in bucket.get("metrics/rollout-w1.jsonl")[0].decode().splitlines()
               for st in json.loads(x).get("group_status", {}).values())
    st = proxy.stats()
    assert sent >= 1 and st["workers"]["w1"]["groups"] == sent and st["fleet"]["groups_released_at_leave"] == 0


# ---- the supervisor applies the decisions on emulated Jobs ----------------------------------------------------


IDLE = "import time; time.sleep(600)\n"


@pytest.fixture
def autoscaled_run(tmp_path, monkeypatch, s3_env, spawn, bucket, run_name):
    """A run whose plan asks for autoscaling: trainer and rollout-1 as idle jobs on the emulator (their signals come
    from this test's calls to the real proxy, recorded in proxy/endpoint.json as a relaunched one would be)."""
    p = spawn("--pace", "--max-staleness", "1")
    for k, v in {**TOKENS, "PROXY_TOKEN": p.token}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PROXY_URL", raising=False)
    emu = JobsEmulator(tmp_path / "jobs").install(monkeypatch)
    proxy_client.write_proxy_endpoint(bucket, p.url, job_id="proxy-job", incarnation=0, written_by="test")
    (tmp_path / "idle.py").write_text(IDLE)
    specs = [JobSpec("trainer", "idle.py", [], ["--max-steps", "50"], "a10g-small", [], {}, timeout="30m"),
             JobSpec("rollout-1", "idle.py", [], ["--worker-id", f"{run_name}-w1", "--seed", "1"], "l4x1", [], {},
                     timeout="30m"),
             JobSpec("supervisor", "idle.py", [], [], "cpu-basic", [], {}, timeout="30m")]
    bounds = {"max_workers": 4, "budget_per_hour": 5.0, "min_window_s": 0.5, "min_window_steps": 1, "judge_steps": 1,
              "up_cooldown_s": 60.0, "down_cooldown_s": 3.0, "wait_share_down": 0.3}
    save_launch(bucket, {"run": run_name, "autoscale": bounds}, specs, {"idle.py": tmp_path / "idle.py"})
    api = HfApi()
    for spec in specs[:2]:   # what the launcher would have started
        api.run_uv_job(str(tmp_path / spec.script), script_args=spec.args, timeout=spec.timeout, namespace="alice",
                       labels={"async-grpo-run": run_name, "role": spec.role})
    yield p, emu
    emu.close()


def ack(p, batch_id: str) -> None:
    assert p.http.post(f"/v1/batches/{batch_id}/ack").is_success


def train_a_step(bucket, p, n: int, version: int) -> None:
    """The trainer leases a batch of `n` groups already in the buffer, registers `version` and acks the batch (a
    step in the window)."""
    got = lease(p, n, left=30)
    assert len(got["groups"]) == n, got
    register(bucket, p, version)
    ack(p, got["batch_id"])


def supervisor(bucket, run_name, tmp_path, name: str) -> Supervisor:
    sup = Supervisor(HfApi(), bucket, run_name, "alice", TOKENS["HF_TOKEN"], Policy(poll_s=0.2, drain_s=1.0),
                     tmp_path / name)
    sup.load()
    return sup


def running(emu, role: str) -> list:
    return [j for j in emu.by_role(role) if j.stage()[0] == "RUNNING"]


@pytest.mark.timeout(120)
def test_the_supervisor_scales_up_when_the_trainer_waits_and_down_when_workers_wait(autoscaled_run, bucket, run_name,
                                                                                     tmp_path, capsys):
    p, emu = autoscaled_run
    sup = supervisor(bucket, run_name, tmp_path, "a")
    assert sup.look() is None                                  # w1 has sent no group yet: it counts as starting
    assert [d["why"] for d in bucket.get_json(STATE)["decisions"]] == ["starting"]
    # the trainer: one batch trained, then it waits 1 s for the next one with nothing in the buffer
    assert lease(p, 4, left=40)["batch_id"] is None
    assert len(granted(p, f"{run_name}-w1")) == 4 and deliver(p, f"{run_name}-w1", 0, 4) == ["accepted"] * 4
    first = lease(p, 4, left=40)["batch_id"]
    assert first
    assert sup.look() is None                                  # the window starts once the trainer holds a batch
    assert bucket.get_json(STATE)["decisions"][-1]["why"] == "no_window"
    register(bucket, p, 1)
    ack(p, first)
    assert lease(p, 4, left=36, wait_s=1.0)["batch_id"] is None
    assert sup.look() is None
    state = bucket.get_json(STATE)
    up = state["decisions"][-1]
    assert up["action"] == "up" and up["why"] == "trainer_waits" and up["signals"]["trainer_util"] < 0.85, up
    assert state["fleet"][:2] == ["rollout-1", "rollout-2"] and len(state["fleet"]) == 1 + up["n"]
    (w2,) = wait_for(lambda: running(emu, "rollout-2"), 30, msg="rollout-2 running")
    assert " ".join(w2.spec["command"]).endswith(f"--worker-id {run_name}-w2 --seed 2")   # rollout-1's, its own id
    n_jobs = len(emu.jobs)

    # a supervisor restarted now sees the new jobs and the cool-down: it launches nothing more
    sup2 = supervisor(bucket, run_name, tmp_path, "b")
    assert lease(p, 4, left=36, wait_s=0.6)["batch_id"] is None
    sup2.look()
    assert sup2.look() is None and len(emu.jobs) == n_jobs, [j.spec["labels"] for j in emu.jobs.values()]
    assert "autoscale: up" in capsys.readouterr().out

    # restarted between writing a decision and launching: the successor launches the decided role exactly once
    scaler = sup2.scaler
    state = bucket.get_json(STATE)
    decided = apply(state, Decision("up", 1, "trainer_waits", "written, then the supervisor died", len(state["fleet"]),
                                    at=time.time()))
    bucket.put_json(STATE, decided)
    new_role = decided["fleet"][-1]
    sup3 = supervisor(bucket, run_name, tmp_path, "c")
    for _ in range(3):
        sup3.look()
    assert len(emu.by_role(new_role)) == 1 and len(emu.jobs) == n_jobs + 1
    assert scaler.bounds == sup3.scaler.bounds

    # the trainer is busy (no lease request open) and the window is full (two grants of 4 at version 1): every worker
    # of the fleet waits for a grant. After the cool-down, one worker leaves: the newest
    wait_for(lambda: all(running(emu, r) for r in decided["fleet"]), 30, msg="the fleet running")
    assert all(len(granted(p, f)) == 4 for f in ("filler-a", "filler-b"))
    ids = [f"{run_name}-w{r.split('-')[1]}" for r in decided["fleet"]]
    for w in ids:             # each worker's first groups: none counts as starting any more
        assert deliver(p, w, 1, 2) == ["accepted"] * 2
    time.sleep(3.0)   # down_cooldown_s
    train_a_step(bucket, p, 3, 2)
    sup3.look()       # a window read (one step, no wait): the next one starts here
    assert bucket.get_json(STATE)["decisions"][-1]["why"] == "steady"
    waits = [Worker(lambda w=w: ask(p, w, wait_s=2.0)) for w in ids]
    for w in waits:
        w.start()
    for w in waits:
        assert w.join(30)["indices"] == []
    train_a_step(bucket, p, 3, 3)
    sup3.look()
    state = bucket.get_json(STATE)
    down = state["decisions"][-1]
    assert down["action"] == "down" and down["why"] == "workers_wait", state["decisions"]
    (retired,) = state["retired"]
    assert retired == new_role and retired not in state["fleet"]
    wid = f"{run_name}-w{retired.split('-')[1]}"
    assert wid in p.stats()["fleet"]["asked_to_leave"]       # told through the proxy
    (job,) = emu.by_role(retired)
    time.sleep(1.2)   # drain_s: an idle job never asks again, so it is cancelled
    sup3.look()
    assert job.stage()[0] == "CANCELED"
    sup3.look()
    assert len(emu.by_role(retired)) == 1                     # retired: never relaunched


def test_the_launcher_records_the_bounds_in_the_plan_and_refuses_autoscaling_without_a_supervisor(tmp_path):
    """`--autoscale` takes the preset's bounds (jobs-autoscale), else Bounds' defaults (what goes into launch/plan.json:
    test_jobs.py). Without the supervisor nothing would decide: refused before any job starts."""
    import launch_hf
    from conftest import ROOT
    from dataclasses import asdict
    assert launch_hf.autoscale_bounds(launch_hf.Args(run="r")) is None                 # the jobs preset: a fixed fleet
    assert launch_hf.autoscale_bounds(launch_hf.Args(run="r", autoscale=True)) == asdict(Bounds())
    got = launch_hf.autoscale_bounds(launch_hf.Args(run="r", preset="jobs-autoscale"))
    assert (got["max_workers"], got["budget_per_hour"]) == (4, 5.0)
    with pytest.raises(SystemExit, match="--autoscale needs the supervisor"):
        launch_hf.autoscale_bounds(launch_hf.Args(run="r", autoscale=True, supervise=False))
    # the dry run says so, and a cap below what the run's other jobs cost is refused before anything is printed
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    run = lambda *a: subprocess.run(["bash", str(ROOT / "launch_jobs.sh"), "--dry-run", "--run", "my-run", *a],  # noqa: E731
                                    cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    p = run("--preset", "jobs-autoscale")
    assert p.returncode == 0 and "# autoscaled (docs/jobs.md#autoscaling): the supervisor keeps 1 to 4 rollout job(s), " \
        "at most $5.0/hour" in p.stdout, p.stderr[-2000:]
