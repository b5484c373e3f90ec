"""A participant that lies in each way docs/trust.md lists, in turn: the model of a hostile contributor for
tests/test_trust.py's acceptance run and bench/audit_cost.py's learning comparison."""
import contextlib
import itertools
import time
import uuid

import httpx

from proxyproc import wait_for
from runlib import journal


def hostile(url: str, token: str, tok, owner, bucket, said: list, done: list) -> None:
    """A participant that lies in each way in turn, each once, waiting (bounded) for each lie to be caught
    before the next: its rewards inflated, its prompt tokens not those of the prompt leased, its behaviour
    logprobs made up (these three the trainer's audit catches), the logprobs lie's prompt answered again as soon
    as the proxy took it, a group on a lease never handed out, and an honest participant's group sent again as
    its own (the proxy catches those three).
    Its completions are real tokens of a text whose reward it computes with the task, as an honest worker would."""
    from models import encode_prompt
    from tasks import load_task
    task, count = load_task("addition"), itertools.count()
    size = owner.stats()["group_size"]  # the run's: a group of another size is refused (422) before any check
    me = httpx.Client(base_url=url, headers={"x-proxy-token": token}, timeout=30)
    checks = lambda: owner.stats()["participants"]["mallory"].get("checks", {})  # noqa: E731 - the owner's view

    def caught(kind: str, before: dict) -> bool:
        """The owner's view shows `kind` caught since `before` (a replayed group the proxy's fingerprint window
        no longer holds is caught by the trainer's audit under another check's name: any failed check then)."""
        now = checks()
        if kind == "replayed":
            return now.get("failed", 0) > before.get("failed", 0)
        return now.get("by_check", {}).get(kind, 0) > before.get("by_check", {}).get(kind, 0)

    def lease() -> tuple[dict, int]:
        while (r := me.post("/v1/prompts/lease", json={"dataset": task.name, "size": len(task.prompts), "n": 1})).status_code == 503:
            time.sleep(float(r.headers.get("Retry-After", "1")))  # the trainer has not opened its task's dataset yet
        got = r.json()
        return {"lease_id": got["lease_id"], "prompt_index": got["indices"][0]}, got["indices"][0]

    def crafted(version: int, inflate=False, other_prompt=False, logprobs=None) -> dict:
        lease_, i = lease()
        for text in ("I think the answer is 7", "I think the answer is 8"):  # an inflated reward must be a lie:
            ids = tok.encode(text, add_special_tokens=False)                # not 7 where the sum is 7
            honest = task.reward(tok.decode(ids, skip_special_tokens=True), i)[0]
            if not (inflate and honest == 1.0):
                break
        nth = next(count)  # each group's completions its own: the same ones again would be refused as a replay
        comps = [{"token_ids": ids, "logprobs": [(logprobs or -11.0) - 0.01 * k - 1e-4 * nth] * len(ids),
                  "reward": 1.0 if inflate else honest, "finish_reason": "stop"} for k in range(size)]
        comps[0]["logprobs"] = [x - 0.5 for x in comps[0]["logprobs"]]  # not all alike
        p = encode_prompt(tok, task.prompts[(i + 1) % len(task.prompts) if other_prompt else i])
        return {"group_id": uuid.uuid4().hex, "worker_id": "m1", "policy_version": version, **lease_,
                "prompt_ids": p, "completions": comps, "meta": {"task": task.name, "prompt_index": i, "temperature": 1.0}}

    def lie(kind: str, make, then=None) -> dict:
        """Send make()'s group; one the proxy takes must be caught by the trainer. A group that went stale while
        waiting for room, or in the buffer before the trainer leased it (the honest worker keeps it full), is
        never audited: made and sent afresh; so is one whose prompt lease was let go while it waited. then(group),
        if given, runs once the proxy has taken the group (while its prompt lease is surely still open: a lease is
        let go once its groups would be stale)."""
        def send():  # the honest worker keeps the buffer full: 429 until the trainer leases. Each try claims the
            nonlocal g  # latest version, so that a group that waited for room does not go in already stale
            g = {**g, "policy_version": latest()}
            return (r := me.post("/v1/groups", json=g)).status_code != 429 and r

        for _ in range(8):
            g, before = make(), checks()
            r = wait_for(send, 120, every=0.5, msg="room in the buffer")
            if r.status_code == 409:
                if r.json()["detail"].startswith("forgotten"):  # its prompt lease was let go while it waited for
                    continue                                     # room (staler than the floor; not a lie): afresh
                break
            assert r.status_code == 200 and r.json()["status"] in ("accepted", "stale"), r.text
            if r.json()["status"] == "stale":  # it waited for room while the trainer moved on: made afresh
                continue
            if then is not None:
                then(g)
                then = None
            with contextlib.suppress(AssertionError):
                wait_for(lambda: caught(kind, before), 60, every=0.5, msg=f"the trainer catching the {kind} lie")
                break
        said.append((kind, r.status_code, r.text))
        assert caught(kind, before), f"the {kind} lie was not caught: {r.status_code} {r.text}"
        return g

    latest = lambda: me.get("/v1/adapters/latest").json()["version"]  # noqa: E731
    wait_for(lambda: latest() >= 1, 240, every=0.5, msg="version 1")
    lie("reward", lambda: crafted(latest(), inflate=True))
    lie("prompt", lambda: crafted(latest(), other_prompt=True))
    # the prompt the logprobs lie answered, answered again at once (the latest version: not dropped as stale)
    lie("logprobs", lambda: crafted(latest(), logprobs=-0.05),
        then=lambda answered: lie("reused", lambda: {**answered, "group_id": uuid.uuid4().hex, "policy_version": latest()}))
    lie("unleased", lambda: {**crafted(latest()), "lease_id": uuid.uuid4().hex})
    def replay() -> dict:  # the honest worker's newest group (leaked, say), claimed as sampled by the latest version
        guest = max((g for g in journal(bucket)[0] if g.get("participant") == "guest"), key=lambda g: g["policy_version"])
        comps = [{k: v for k, v in c.items() if k != "versions"} for c in guest["completions"]]
        return {k: v for k, v in {**guest, "group_id": uuid.uuid4().hex, **lease()[0], "policy_version": latest(),
                                  "completions": comps}.items() if k not in ("participant", "prompt_dataset")}
    lie("replayed", replay)
    done.append(True)
