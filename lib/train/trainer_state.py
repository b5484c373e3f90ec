"""What keeps one trainer's progress durable across crashes and relaunches (train.py uses it):

  1. checkpoints   adapter, optimizer, scheduler, RNG, step, version and the trained groups, each file with its
                   sha256 and the protocol that wrote them, then the checkpoints/latest.json pointer
  2. ownership     one trainer per run: trainer/owner.json, a conditional-write claim with a heartbeat
  3. trained groups batches acked only after the checkpoint that holds their update; groups our weights
                   hold are never trained twice, whatever a lease expiry hands out again
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import threading
import time

import httpx
import torch

from common import PROTOCOL, Bucket, ConflictError, ProtocolError, check_protocol, too_stale
from proxy_client import ProxyClient, ProxyError


# ---------------------------------------------------------------------------------------------
# checkpoints: checkpoints/step_{S:08d}/{adapter files, trainer_state.pt, meta.json}, then the
# checkpoints/latest.json pointer (written last, so a reader only ever sees complete checkpoints)


def save_checkpoint(bucket: Bucket, model, opt, sched, state: dict) -> None:
    prefix = f"checkpoints/step_{state['step']:08d}"
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), **state,
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}},
                   os.path.join(d, "trainer_state.pt"))
        files = {}
        for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"):
            data = open(os.path.join(d, name), "rb").read()
            files[name] = hashlib.sha256(data).hexdigest()
            bucket.put(f"{prefix}/{name}", data)
    bucket.put_json(f"{prefix}/meta.json", {"protocol": PROTOCOL, "step": state["step"], "version": state["version"],
                                            "files": files})
    bucket.put_json("checkpoints/latest.json", {"step": state["step"], "version": state["version"], "prefix": prefix})


def load_checkpoint(bucket: Bucket, model, opt, sched) -> dict | None:
    """Restore the newest complete checkpoint into model/opt/sched; returns its state or None.
    A checkpoint that is incomplete, fails its sha256 or was written in another protocol (common.PROTOCOL)
    stops the trainer: no retry can fix it."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    ptr = bucket.get_json("checkpoints/latest.json")
    if ptr is None:
        return None
    where = f"s3://{bucket.bucket}/{bucket.key(ptr['prefix'])}"
    meta = bucket.get_json(f"{ptr['prefix']}/meta.json")
    if meta is None:
        raise SystemExit(f"checkpoint {where}: checkpoints/latest.json names it but its meta.json is missing: "
                         f"refusing to resume (point checkpoints/latest.json at an older one, or --fresh)")
    try:
        check_protocol(meta.get("protocol"), f"checkpoint {where}",
                       "resume it with the clone of this repository that wrote it, or start over: --fresh (its weights "
                       "and records ignored), or a new run (RUN_NAME; the launcher's --run)")
    except ProtocolError as e:
        raise SystemExit(str(e)) from None
    with tempfile.TemporaryDirectory() as d:
        for name, digest in meta["files"].items():
            got = bucket.get(f"{ptr['prefix']}/{name}")
            if got is None:
                raise SystemExit(f"checkpoint {where}/{name} is missing: refusing to resume")
            if hashlib.sha256(got[0]).hexdigest() != digest:
                raise SystemExit(f"checkpoint {where}/{name} does not match its sha256: refusing to resume")
            open(os.path.join(d, name), "wb").write(got[0])
        set_peft_model_state_dict(model, load_file(os.path.join(d, "adapter_model.safetensors")))
        state = torch.load(os.path.join(d, "trainer_state.pt"), weights_only=False)
    opt.load_state_dict(state.pop("optimizer"))
    sched.load_state_dict(state.pop("scheduler"))
    rng = state.pop("rng")
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return state


# ---------------------------------------------------------------------------------------------
# one trainer per run: trainer/owner.json holds the owner's id and a heartbeat, each write
# conditional on the last. Another id with a fresh heartbeat: the newcomer fails at once. The same
# id (a relaunch, or a trainer started twice): the newcomer takes over at once, and the old one, at
# its next heartbeat, finds the ETag changed and stops without writing anything more. A trainer
# heartbeats before each step's writes (publish, checkpoint, acks), so the old one can finish at
# most the one it is in, and the newcomer publishes past the version that one took.


class TakenOver(SystemExit):
    """Another trainer owns the run now."""


def claim_run(bucket: Bucket, trainer_id: str, ttl: float) -> str:
    """Claim the run; returns the ETag for later heartbeats. Fails at once if another id holds a
    fresh heartbeat, or if another trainer claims it at the same moment."""
    got = bucket.get("trainer/owner.json")
    if got is not None:
        owner = json.loads(got[0])
        age = time.time() - owner["heartbeat"]
        if owner["id"] != trainer_id and age < ttl:
            raise SystemExit(f"another trainer ({owner['id']!r}, heartbeat {age:.0f}s ago) owns run "
                             f"{bucket.run!r}; stop it, or wait {ttl - age:.0f}s if it is dead")
    body = {"id": trainer_id, "heartbeat": time.time()}
    try:
        return bucket.put_json("trainer/owner.json", body, **({"if_match": got[1]} if got else {"if_none_match": True}))
    except ConflictError:
        raise SystemExit(f"another trainer claimed run {bucket.run!r} at the same moment: this one stops") from None


def heartbeat(bucket: Bucket, trainer_id: str, etag: str) -> str:
    try:
        return bucket.put_json("trainer/owner.json", {"id": trainer_id, "heartbeat": time.time()}, if_match=etag)
    except ConflictError:
        raise TakenOver(f"run {bucket.run!r} was taken over by another trainer (trainer/owner.json changed; "
                        f"a relaunch with the same TRAINER_ID {trainer_id!r}?): stopping without writing anything more") from None


class Owner:
    def __init__(self, bucket: Bucket, trainer_id: str, ttl: float):
        self.bucket, self.id = bucket, trainer_id
        self.etag = claim_run(bucket, trainer_id, ttl)
        self.on_lost = lambda: None  # called before TakenOver propagates (the metrics stop uploading)
        # the main loop and the thread that asks for the next batch both heartbeat: two conditional writes on
        # one ETag at once, and the slower one's 412 would read as a takeover (test_chaos met it)
        self.lock = threading.Lock()

    def check(self) -> None:
        """Heartbeat; raises TakenOver if the run is no longer ours. One at a time, from any thread."""
        with self.lock:
            try:
                self.etag = heartbeat(self.bucket, self.id, self.etag)
            except TakenOver:
                self.on_lost()
                raise


# ---------------------------------------------------------------------------------------------
# the trained groups: a batch is acked only after the checkpoint that holds its update, so a crash costs the
# steps since that checkpoint and their groups go back to the buffer (re-checked for staleness)
# instead of being consumed by weights that died with the trainer.


class TrainedGroups:
    """The batches whose update our weights hold and that the proxy has not recorded as acked
    (`unacked`, saved in each checkpoint), and every group our weights hold that the proxy might
    still hand out (`trained`: group_id -> policy_version). A thread renews our open leases. If one
    runs out anyway (the trainer stalled past the proxy's --lease-s), the proxy hands its groups out
    again; they are dropped from the batch that brings them back: no group is trained twice."""

    def __init__(self, client: ProxyClient, saved: dict | None, say, max_staleness: int):
        """saved: a checkpoint's state() (None: nothing trained yet); max_staleness: the proxy's (GET /v1/whoami)."""
        saved = saved or {"unacked": {}, "trained": {}}
        self.client, self.say = client, say
        self.renewer = client.with_patience(0)  # best effort: a missed renewal costs at most a 410, handled
        self.unacked: dict[str, list[str]] = {b: list(g) for b, g in saved["unacked"].items()}
        self.trained: dict[str, int] = dict(saved["trained"])
        self.renew_at: dict[str, float] = {}  # batch_id -> monotonic time of its next renewal
        self.max_staleness = max_staleness  # groups staler than that never come back
        self.lock = threading.Lock()
        threading.Thread(target=self._renew_loop, daemon=True).start()

    def state(self) -> dict:
        with self.lock:
            return {"unacked": {b: list(g) for b, g in self.unacked.items()}, "trained": dict(self.trained)}

    def hold(self, got: dict) -> tuple[list[dict], list[str]]:
        """A new lease: keep it renewed from now on (a step may outlast it). Returns its groups our
        weights do not hold yet, and the ids of those they do."""
        with self.lock:
            self.renew_at[got["batch_id"]] = time.monotonic() + got["expires_in_s"] / 2
            fresh = [g for g in got["groups"] if g["group_id"] not in self.trained]
        return fresh, [g["group_id"] for g in got["groups"] if g["group_id"] in self.trained]

    def trained_on(self, got: dict) -> None:
        """The step on this batch is taken: its update is in our weights, to be acked after a checkpoint."""
        with self.lock:
            self.unacked[got["batch_id"]] = [g["group_id"] for g in got["groups"]]
            self.trained.update({g["group_id"]: g["policy_version"] for g in got["groups"]})
            latest = got["latest_version"]
            for gid in [g for g, v in self.trained.items() if too_stale(v, latest, self.max_staleness)]:
                del self.trained[gid]  # the proxy drops these when they come back: no guard needed

    def ack_all(self, owner: "Owner") -> None:
        """Ack every batch a checkpoint now holds. 409 (already acked) is our own earlier ack; 410/404
        (the lease ran out) leaves its groups in `trained`. Gives up only when we are stopping (the
        proxy unreachable after SIGTERM): the checkpoint's record of them acks them at the next start."""
        if self.unacked:
            owner.check()  # a takeover's old owner must not consume groups the new one has not trained
        for bid in list(self.unacked):
            try:
                self.client.post(f"/v1/batches/{bid}/ack")
                acked = True
            except ProxyError as e:
                if e.status not in (404, 409, 410):
                    raise
                acked = e.status == 409
                if not acked:
                    self.say(f"lease {bid} ran out before its ack ({e.detail}); its {len(self.unacked[bid])} "
                             f"groups are in our weights already and will be dropped if handed out again")
            except httpx.HTTPError as e:
                self.say(f"stopping with {len(self.unacked)} batch(es) unacked ({type(e).__name__}): the checkpoint's "
                         f"record of trained groups acks them at the next start")
                return
            with self.lock:
                groups = self.unacked.pop(bid)
                self.renew_at.pop(bid, None)
                if acked:  # consumed for good: the proxy never hands these out again
                    for gid in groups:
                        self.trained.pop(gid, None)

    def release(self, got: dict) -> None:
        """A batch we will not train (we stop before its step): no longer renewed, and back in the proxy's
        buffer now (best effort: else its lease runs out, --lease-s)."""
        with self.lock:
            self.renew_at.pop(got["batch_id"], None)
        try:
            self.renewer.post(f"/v1/batches/{got['batch_id']}/release")
        except (ProxyError, httpx.HTTPError) as e:
            self.say(f"the batch asked for ahead was not released ({type(e).__name__}): its groups go back to the "
                     f"buffer when its lease runs out")

    def _renew_loop(self) -> None:
        while True:
            time.sleep(1.0)
            with self.lock:
                due = [b for b, t in self.renew_at.items() if t <= time.monotonic()]
            for bid in due:
                try:
                    nxt = time.monotonic() + self.renewer.post(f"/v1/batches/{bid}/renew")["expires_in_s"] / 2
                except ProxyError:
                    nxt = None  # acked, ran out, or unknown: nothing left to renew
                except httpx.HTTPError:
                    nxt = time.monotonic() + 5.0  # proxy unreachable: try again soon
                with self.lock:
                    if bid in self.renew_at:
                        if nxt is None:
                            del self.renew_at[bid]
                        else:
                            self.renew_at[bid] = nxt
