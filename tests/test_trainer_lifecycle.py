"""The trainer's lifecycle as real processes on the tiny model: killed at every point of its last
step, started twice with the same TRAINER_ID (the two claims ordered exactly), stalled past its
leases. The run always finishes, with the final version registered once, exactly one trainer left,
and no group trained twice."""
import json
import os
import random
import re
import signal
import threading
import time

import httpx
import pytest

import common
from conftest import PY, ROOT, free_port, stop, wait_http
from runlib import Role, audit, check_adapters, journal, steps, wait_for
from tcp_forward import Forwarder

pytestmark = pytest.mark.slow


def _run(tiny_model, s3_env, tmp_path, run_name, *proxy_flags, trainer_s3: str | None = None,
         trainer_proxy: str | None = None) -> tuple[Role, Role, dict]:
    """A proxy and one worker, started; and an unstarted trainer (pointed at `trainer_s3` and
    `trainer_proxy` when given: the watching forwarders)."""
    proxy_port = free_port()
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": f"http://127.0.0.1:{proxy_port}", "PROXY_TOKEN": "t0ken",
           "OMP_NUM_THREADS": "1", "TRAINER_ID": "the-trainer", "SPOOL_DIR": str(tmp_path / "spool")}
    proxy = Role("proxy", [PY, str(ROOT / "proxy.py"), "--port", str(proxy_port), "--group-size", "4", *proxy_flags],
                 env, tmp_path).start()
    wait_http(env["PROXY_URL"] + "/health", proxy.proc)
    worker = Role("worker", [PY, str(ROOT / "rollout.py"), "--model", tiny_model, "--group-size", "4",
                             "--prompts-per-round", "2", "--max-new-tokens", "6", "--worker-id", "w1"], env, tmp_path).start()
    tenv = {**env, **({"S3_ENDPOINT_URL": trainer_s3} if trainer_s3 else {}),
            **({"PROXY_URL": trainer_proxy} if trainer_proxy else {})}
    trainer = Role("trainer", [PY, str(ROOT / "train.py"), "--model", tiny_model, "--batch-groups", "2", "--lr", "1e-3",
                               "--lease-wait-s", "2", "--no-skip-zero-std"], tenv, tmp_path)
    return proxy, worker, {"proxy": proxy, "worker": worker, "trainer": trainer, "env": env}


def _proxy_latest(env: dict) -> dict:
    return httpx.get(env["PROXY_URL"] + "/v1/adapters/latest", headers={"X-Proxy-Token": env["PROXY_TOKEN"]}).json()


def _end_cleanly(roles: dict) -> None:
    roles["proxy"].proc.send_signal(signal.SIGTERM)
    assert roles["proxy"].proc.wait(timeout=30) in (0, -signal.SIGTERM) and "proxy: stopped cleanly" in roles["proxy"].text()


M = 3  # steps of the end-of-run test; a checkpoint after each
# (event, what the request line matches, name): the points of the last step, in the order the test
# kills at them. The first four happen while the last step is taken (each restart redoes it from
# the checkpoint of step M-1); the others while a restart finishes what the killed one left.
KILL_POINTS = [
    ("request", r"^PUT /\S+/adapters/v\d+/", "before publish"),
    ("response", r"^PUT /\S+/adapters/latest\.json ", "after publish"),
    ("request", r"^PUT /\S+/checkpoints/step_", "before checkpoint"),
    ("response", r"^PUT /\S+/checkpoints/latest\.json ", "after checkpoint"),
    ("request", r"^POST /v1/batches/\w+/ack ", "before ack"),
    ("response", r"^POST /v1/batches/\w+/ack ", "after ack"),
    ("request", r"^POST /v1/adapters ", "before final registration"),
    ("response", r"^POST /v1/adapters ", "after final registration"),
]


@pytest.mark.timeout(900)  # nine trainer starts: 2.5 min on a quiet machine
def test_killed_at_every_point_of_its_last_step_the_run_still_finishes(tiny_model, s3_env, tmp_path, run_name):
    """kill -9 of the trainer at each point of its last step (before and after publish, checkpoint,
    ack and the final registration), each time relaunched with the same TRAINER_ID. The points are
    hit exactly: two forwarders between the trainer and the bucket / the proxy watch its requests
    and kill it as one goes out or its answer comes back."""
    moto_port = int(s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1])
    armed: list = [None]  # the kill point the watch waits for
    checkpoints_done = [0]
    fired: list[str] = []

    def watch(event: str, line: str) -> bool:
        if event == "response" and re.match(KILL_POINTS[3][1], line):
            checkpoints_done[0] += 1
            if armed[0] is None and checkpoints_done[0] == M - 1 and not fired:
                armed[0] = KILL_POINTS[0]  # step M-1 is checkpointed: what comes next is the last step
        point = armed[0]
        if point is None or event != point[0] or not re.match(point[1], line):
            return False
        armed[0] = None
        os.kill(roles["trainer"].proc.pid, signal.SIGKILL)
        fired.append(point[2])
        return True  # cut there: before = never reaches the server, after = the answer never comes back

    s3_fwd = Forwarder(moto_port, watch)
    roles: dict = {}
    try:
        # leases outlive the restarts here, so that the acks after one meet open leases, not 410s
        proxy, worker, roles = _run(tiny_model, s3_env, tmp_path, run_name, "--lease-s", "600", "--max-buffer", "8",
                                    trainer_s3=f"http://127.0.0.1:{s3_fwd.port}")
        env = roles["env"]
        proxy_fwd = Forwarder(int(env["PROXY_URL"].rsplit(":", 1)[1]), watch)
        trainer = roles["trainer"]
        trainer.env["PROXY_URL"] = f"http://127.0.0.1:{proxy_fwd.port}"
        args = ["--max-steps", str(M), "--checkpoint-every", "1"]
        trainer.start(*args)
        for i, (_, _, name) in enumerate(KILL_POINTS):
            wait_for(lambda: len(fired) > i, 300, f"the trainer reaching the point '{name}'", trainer)
            trainer.proc.wait(timeout=30)
            # nothing more is needed from the workers only once the final version is registered: then a worker
            # may be gone already (it exits as soon as it hears of the final version), and must be gone soon (below)
            done = name == "after final registration"
            assert done or worker.alive(), f"the worker exited while the trainer was down ({name})\n{worker.text()[-2000:]}"
            assert _proxy_latest(env)["done"] == done, name
            if i + 1 < len(KILL_POINTS):
                armed[0] = KILL_POINTS[i + 1]
            trainer.start(*args)
        assert trainer.proc.wait(timeout=300) == 0, trainer.last_run()[-3000:]
        assert worker.proc.wait(timeout=120) == 0, worker.text()[-3000:]  # gone once the final version is registered
        _end_cleanly(roles)
    finally:
        for r in roles.values():
            if isinstance(r, Role) and r.proc is not None:
                stop(r.proc)
        s3_fwd.close()
    assert fired == [name for _, _, name in KILL_POINTS]

    bucket = common.Bucket(run=run_name)
    got = audit(bucket)
    assert got["steps"] == list(range(1, M + 1))
    metas = check_adapters(bucket)
    finals = [v for v in got["versions"] if v["final"]]
    assert len(finals) == 1 and finals[0] == got["versions"][-1] and finals[0]["version"] == metas[-1]["version"]
    assert bucket.get_json("checkpoints/latest.json")["step"] == M
    print("\nEND-OF-RUN", json.dumps({"versions_published": len(metas), "trainer_starts": trainer.starts,
                                      "groups_trained": len(got["trained"])}))


OWNER_GET = re.compile(r"^GET /\S+/trainer/owner\.json ")
OWNER_PUT = re.compile(r"^PUT /\S+/trainer/owner\.json ")


class ClaimGate:
    """The watch of a forwarder between one trainer and the bucket, around trainer/owner.json: the
    trainer's first read of it and its first write are its claim (trainer_state.claim_run), its later
    writes heartbeats. A held claim waits before going upstream until `release` is set; `arrived` says
    it is waiting, `answered` that its answer came back. With a `peer` (the other trainer's gate, one
    lock for both), a claim fences the peer's heartbeats off from its read until its answer: nothing of
    the peer's lands between this trainer's read of owner.json and its conditional write."""

    HOLD_S = 45  # under botocore's 60 s read timeout: a held request must not be retried

    def __init__(self, hold: bool, lock: threading.Lock):
        self.arrived, self.release, self.answered, self.claiming = (threading.Event() for _ in range(4))
        if not hold:
            self.release.set()
        self.lock, self.peer, self.writes, self.in_flight, self.arrived_at = lock, None, 0, 0, None
        self.failures: list[str] = []

    def watch(self, event: str, line: str) -> bool:
        if event == "request" and OWNER_GET.match(line) and not self.writes and self.peer is not None:
            with self.lock:  # our claim begins: the peer's heartbeats wait from now until its answer
                self.claiming.set()
            t0 = time.time()
            while self.peer.in_flight and time.time() - t0 < self.HOLD_S:  # one already sent: its answer first
                time.sleep(0.01)
        elif event == "request" and OWNER_PUT.match(line):
            self.writes += 1
            if self.writes == 1:  # the claim
                self.arrived_at = time.time()
                self.arrived.set()
                if not self.release.wait(self.HOLD_S):
                    self.failures.append("a held claim was never released")
            while self.peer is not None:  # a heartbeat: not while the peer claims
                with self.lock:
                    if not (self.peer.claiming.is_set() and not self.peer.answered.is_set()):
                        self.in_flight += 1
                        break
                if not self.peer.answered.wait(self.HOLD_S):
                    self.failures.append("the peer's claim was never answered")
                    break
        elif event == "response" and OWNER_PUT.match(line):
            self.in_flight = max(0, self.in_flight - 1)
            self.answered.set()  # (the first answer is the claim's)
        return False


# how each pair starts, one pair after the other in one run: "same moment" = both trainers read
# owner.json and hold their claims until both are there, then one claim goes first and is answered
# before the other is let through: the other's conditional write loses (claim_run's "at the same
# moment"); "after" = the second starts only once the first's claim is answered, and claims over it
# (the same TRAINER_ID), and the first's next heartbeat finds its ETag gone ("taken over")
PAIRS = [("same moment", r"claimed run \S+ at the same moment: this one stops"),
         ("after", r"was taken over by another trainer \(trainer/owner\.json changed"),
         ("same moment", r"claimed run \S+ at the same moment: this one stops")]


@pytest.mark.timeout(900)  # six trainer starts: 2.5 min on a quiet machine
def test_same_id_started_twice_leaves_exactly_one_trainer(tiny_model, s3_env, tmp_path, run_name, seed):
    """Two trainers with the same TRAINER_ID, three pairs one after the other in one run (PAIRS), each
    trainer's bucket traffic through a forwarder that orders the two claims exactly: each time the
    trainer that must lose (the one let through second at the same moment; the first one when the
    second came after) stops with the message of that code path and no traceback, the other trains on.
    The last survivor finishes the run."""
    rng = random.Random(seed)  # which trainer of a same-moment pair claims first
    moto_port = int(s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1])
    proxy, worker, roles = _run(tiny_model, s3_env, tmp_path, run_name, "--lease-s", "20", "--max-buffer", "8")
    trainer = roles["trainer"]
    outcome, pair, forwarders = [], {}, []
    try:
        for n, (how, why) in enumerate(PAIRS):
            last = n == len(PAIRS) - 1
            ckpt = common.Bucket(run=run_name).get_json("checkpoints/latest.json")
            args = ["--max-steps", str((ckpt["step"] if ckpt else 0) + 3) if last else "1000", "--checkpoint-every", "2"]
            lock = threading.Lock()
            gates = {x: ClaimGate(hold=how == "same moment", lock=lock) for x in "ab"}
            if how == "after":
                gates["a"].peer, gates["b"].peer = gates["b"], gates["a"]
            fwd = {x: Forwarder(moto_port, gates[x].watch) for x in "ab"}
            forwarders += fwd.values()
            pair = {x: Role(f"trainer-{n}{x}", trainer.cmd, {**trainer.env, "S3_ENDPOINT_URL": f"http://127.0.0.1:{fwd[x].port}"},
                            tmp_path) for x in "ab"}
            if how == "same moment":
                pair["a"].start(*args)
                pair["b"].start(*args)
                wait_for(lambda: gates["a"].arrived.is_set() and gates["b"].arrived.is_set(), 300,
                         "both trainers holding their claims", alive=tuple(pair.values()))
                first, second = rng.sample("ab", 2)
                gates[first].release.set()
                wait_for(gates[first].answered.is_set, 60, f"trainer {first}'s claim answered")
                gates[second].release.set()
                must_lose = second
            else:
                pair["a"].start(*args)
                wait_for(gates["a"].answered.is_set, 300, "the first trainer's claim answered", alive=(pair["a"],))
                pair["b"].start(*args)
                must_lose = "a"
            wait_for(lambda: not pair["a"].alive() or not pair["b"].alive(), 300, f"one of two trainers stopping ({how})")
            loser, survivor = pair[must_lose], pair["b" if must_lose == "a" else "a"]
            said = loser.last_run()
            assert not loser.alive() and survivor.alive(), f"{survivor.name} stopped, not {loser.name}:\n{survivor.last_run()[-3000:]}"
            assert loser.proc.returncode == 1, said[-3000:]
            assert re.search(why, said), f"{loser.name} did not stop the '{how}' way:\n{said[-3000:]}"
            assert "Traceback" not in said and "ConflictError" not in said, said[-3000:]
            assert not gates["a"].failures + gates["b"].failures, gates["a"].failures + gates["b"].failures
            before = len(steps(survivor))
            if not last:  # the survivor trains on, then is stopped the way HF Jobs cancels a job
                wait_for(lambda: len(steps(survivor)) > before, 300, "the survivor's next step", survivor)
                assert survivor.alive()
                survivor.proc.send_signal(signal.SIGTERM)
                assert survivor.proc.wait(timeout=120) == 0, survivor.last_run()[-3000:]
            else:
                assert survivor.proc.wait(timeout=600) == 0, survivor.last_run()[-3000:]
            outcome.append({"how": how, "stopped": loser.name, "survived": survivor.name,
                            "claims_apart_s": round(abs(gates["a"].arrived_at - gates["b"].arrived_at), 1)})
        assert worker.proc.wait(timeout=120) == 0, worker.text()[-3000:]
        _end_cleanly(roles)
    finally:
        for r in [*pair.values(), proxy, worker]:
            if r.proc is not None:
                stop(r.proc)
        for f in forwarders:
            f.close()
    print("\nTAKEOVER", json.dumps(outcome))
    bucket = common.Bucket(run=run_name)
    check_adapters(bucket)
    assert [v for v in audit(bucket)["versions"] if v["final"]] == audit(bucket)["versions"][-1:]


@pytest.mark.timeout(600)  # about a minute on a quiet machine
def test_a_stalled_trainer_never_trains_a_group_twice(tiny_model, s3_env, tmp_path, run_name):
    """The trainer frozen (SIGSTOP) for longer than the proxy's --lease-s while it holds trained but
    unacked batches: the leases run out, the proxy hands those groups out again, the trainer's ledger
    drops them from the batches that bring them back, and its acks meet 410 without harm."""
    proxy, worker, roles = _run(tiny_model, s3_env, tmp_path, run_name, "--lease-s", "4", "--max-buffer", "16",
                                "--max-staleness", "100")
    trainer = roles["trainer"]
    try:
        # frozen from step 5 on (trained, unacked till the checkpoint of step 8); the steps after it, up
        # to 12, lease again, which brings the groups of the leases that ran out back to it (at the front)
        trainer.start("--max-steps", "12", "--checkpoint-every", "4")
        wait_for(lambda: len(steps(trainer)) >= 5, 300, "five steps", trainer)
        bucket = common.Bucket(run=run_name)
        expiries = lambda: sum(e["t"] == "expire" for e in journal(bucket)[1])  # noqa: E731
        before = expiries()
        trainer.proc.send_signal(signal.SIGSTOP)
        # frozen until every lease it holds ran out (--lease-s 4, the proxy's 1 s sweep), as the proxy's
        # durable log and its stats say
        stats = lambda: httpx.get(roles["env"]["PROXY_URL"] + "/v1/stats",  # noqa: E731
                                  headers={"X-Proxy-Token": roles["env"]["PROXY_TOKEN"]}).json()
        wait_for(lambda: expiries() > before and stats()["open_leases"] == 0, 120,
                 "the frozen trainer's leases running out", alive=(proxy, worker))
        trainer.proc.send_signal(signal.SIGCONT)
        assert trainer.proc.wait(timeout=600) == 0, trainer.text()[-3000:]
        assert worker.proc.wait(timeout=120) == 0, worker.text()[-3000:]
        _end_cleanly(roles)
    finally:
        for r in (trainer, worker, proxy):
            if r.proc is not None:
                stop(r.proc)
    bucket = common.Bucket(run=run_name)
    got = audit(bucket)  # no group trained twice, none acked twice, every acked one trained
    expired = [e for e in got["events"] if e["t"] == "expire"]
    assert expired and "ran out before its ack" in trainer.text()
    assert got["steps"][-1] == 12 and steps(trainer)[-1] == 12
    assert got["skipped"], "no expired group came back: the test did not exercise the ledger"
    print("\nSTALL", json.dumps({"leases_expired": len(expired), "groups_left_out": len(got["skipped"])}))


def test_a_trainer_stopped_while_it_holds_its_next_batch_gives_it_back(tiny_model, s3_env, tmp_path, run_name):
    """SIGTERM while a step's checkpoint is under way and the next batch, asked for ahead (prefetch), is already
    leased: the trainer checkpoints, acks, and releases the batch it will not train, so that nothing stays leased
    for --lease-s (300 s here) and its successor gets those groups at once."""
    moto_port = int(s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1])
    armed, at_checkpoint, go = threading.Event(), threading.Event(), threading.Event()

    def watch(event: str, line: str) -> bool:  # the trainer's bucket traffic held at a checkpoint once armed
        if armed.is_set() and event == "request" and re.match(r"^PUT /\S+/checkpoints/step_", line):
            armed.clear()
            at_checkpoint.set()
            go.wait(120)
        return False

    s3_fwd = Forwarder(moto_port, watch)
    roles: dict = {}
    try:
        proxy, worker, roles = _run(tiny_model, s3_env, tmp_path, run_name, "--lease-s", "300",
                                    trainer_s3=f"http://127.0.0.1:{s3_fwd.port}")
        env, trainer = roles["env"], roles["trainer"]
        stats = lambda: httpx.get(env["PROXY_URL"] + "/v1/stats", headers={"X-Proxy-Token": env["PROXY_TOKEN"]}).json()  # noqa: E731
        trainer.start("--max-steps", "1000", "--checkpoint-every", "1")
        wait_for(lambda: len(steps(trainer)) >= 2, 300, "two steps", trainer)
        armed.set()
        wait_for(at_checkpoint.is_set, 120, "a checkpoint", trainer)
        # the step's own batch (acked after this checkpoint) and the next one, leased while it is held
        wait_for(lambda: stats()["open_leases"] == 2, 120, "the next batch leased ahead", trainer, alive=(proxy, worker))
        trainer.proc.send_signal(signal.SIGTERM)
        go.set()
        assert trainer.proc.wait(timeout=120) == 0, trainer.text()[-3000:]
        assert stats()["open_leases"] == 0, stats()
        assert "not released" not in trainer.text()
        released = lambda: [e for e in journal(common.Bucket(run=run_name))[1] if e["t"] == "expire"]  # noqa: E731
        wait_for(lambda: len(released()) == 1, 30, "the release in the proxy's journal", alive=(proxy,))
    finally:
        go.set()
        for r in roles.values():
            if isinstance(r, Role) and r.proc is not None:
                stop(r.proc)
        s3_fwd.close()


@pytest.mark.timeout(600)  # two trainer starts: about a minute on a quiet machine
def test_killed_between_a_publish_and_its_registration_the_relaunch_trains_on(tiny_model, s3_env, tmp_path, run_name):
    """kill -9 of the trainer once adapters/latest.json names version 2 (a step before the last) and before the proxy
    hears of it; relaunched with prefetch on (the default), it must register that version (the next trainer adopts
    a version published but not registered, as a restarted proxy does), train on and finish the run: the next
    batch, asked for ahead as the version after it, is not refused for being two past the proxy's latest."""
    moto_port = int(s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1])
    latest_puts, fired = [0], []

    def watch(event: str, line: str) -> bool:
        if event == "response" and re.match(r"^PUT /\S+/adapters/latest\.json ", line):
            latest_puts[0] += 1
            if latest_puts[0] == 2 and not fired:  # version 2 published; its registration not sent yet
                os.kill(roles["trainer"].proc.pid, signal.SIGKILL)
                fired.append(time.time())
                return True
        return False

    s3_fwd = Forwarder(moto_port, watch)
    roles: dict = {}
    try:
        proxy, worker, roles = _run(tiny_model, s3_env, tmp_path, run_name, "--lease-s", "600", "--max-buffer", "8",
                                    trainer_s3=f"http://127.0.0.1:{s3_fwd.port}")
        env, trainer = roles["env"], roles["trainer"]
        args = ["--max-steps", "4", "--checkpoint-every", "1"]
        trainer.start(*args)
        wait_for(lambda: bool(fired), 300, "the trainer publishing version 2", trainer)
        trainer.proc.wait(timeout=30)
        assert _proxy_latest(env)["version"] == 1, "the kill came after version 2's registration"
        trainer.start(*args)
        assert trainer.proc.wait(timeout=300) == 0, trainer.last_run()[-3000:]
        assert "409" not in trainer.last_run(), trainer.last_run()[-3000:]
        assert worker.proc.wait(timeout=120) == 0, worker.text()[-3000:]
        _end_cleanly(roles)
    finally:
        for r in roles.values():
            if isinstance(r, Role) and r.proc is not None:
                stop(r.proc)
        s3_fwd.close()
    bucket = common.Bucket(run=run_name)
    got = audit(bucket)
    assert got["steps"] == [1, 2, 3, 4]
    check_adapters(bucket)
    # version 2 registered by the relaunch, before the versions it published itself; the last one final
    assert [v["version"] for v in got["versions"]] == list(range(1, len(got["versions"]) + 1))
    assert got["versions"][-1]["final"] and [v["final"] for v in got["versions"]].count(True) == 1
    print("\nPUBLISHED-NOT-REGISTERED", json.dumps({"versions": [v["version"] for v in got["versions"]]}))
