"""Trust but verify (docs/trust.md): what the proxy checks of a participant's group on arrival (it names a
prompt lease of its sender's, answers it once, and is not another group's completions sent again), how the
trainer's audit reports land, and the quarantine: automatic past --quarantine-after, with its reason in
/v1/stats, /metrics and the journal, a 403 on every route, surviving a restart, lifted by the owner."""
import json
import os
import signal
import subprocess
import sys
import uuid

import httpx
import pytest

from conftest import ROOT, stop
from liar import hostile
from proxyproc import Worker, metric, spawn, wait_for  # noqa: F401 - spawn is a fixture
from runlib import journal
from test_audit_limits import AuditReports, judged_by_the_step
from tasks import load_task
from test_proxy import group, publish
from test_proxy_access import as_, create, leased, open_dataset, own, own_group


def answer(client, g: dict) -> tuple[int, str]:
    r = client.post("/v1/groups", json=g)
    return r.status_code, (r.json()["status"] if r.status_code == 200 else r.json()["detail"])


def test_the_proxy_binds_groups_to_their_leases_and_quarantines_a_liar_across_a_restart(bucket, spawn):
    p = spawn("--quarantine-after", "5")
    publish(bucket, p, 1)
    alice, mallory = as_(p, create(p, "alice")), as_(p, create(p, "mallory"))
    honest = own_group(alice, version=1)
    assert answer(alice, honest) == (200, "accepted")
    assert answer(p.http, group(version=1)) == (200, "accepted")  # the run's own jobs need no lease

    # a participant's group without a lease: refused, not counted (a schema rule, not a lie)
    code, why = answer(mallory, own(group(version=1)))
    assert code == 422 and "must name the prompt lease" in why, why
    # the lies the proxy sees, each a 409 naming it, each counted against mallory
    lies = {
        "unleased": own(group(version=1, lease_id=uuid.uuid4().hex, prompt_index=3)),             # a lease never handed out
        "unleased ": own(group(version=1, **leased(alice)[0])),                                   # alice's lease
        "unleased  ": own(group(version=1, **{**leased(mallory)[0], "prompt_index": 10**6})),     # not an index of hers
    }
    mine = own(group(version=1, **leased(mallory)[0]))
    assert answer(mallory, mine) == (200, "accepted")  # an honest one of hers, first
    lies["reused"] = own({**mine, "group_id": uuid.uuid4().hex})                                  # that prompt again
    lies["replayed"] = {**honest, "group_id": uuid.uuid4().hex, **leased(mallory)[0]}             # alice's completions
    for n, (check, g) in enumerate(lies.items(), 1):
        code, why = answer(mallory, g)
        if n < 5:
            assert code == 409 and why.startswith(check.strip() + ":") and "counted against this participant" in why, (check, why)
        else:  # the fifth failed check: quarantined by it
            assert code == 409 and why.startswith("replayed:") and "now quarantined" in why, why
    # quarantined: every route refuses her token with the reason; her buffered group is held out; alice is fine
    r = mallory.get("/v1/adapters/latest")
    assert r.status_code == 403 and "mallory" in r.text and "quarantined: 5 failed checks (limit 5)" in r.text, r.text
    assert "--token-reinstate mallory" in r.text
    assert mallory.post("/v1/prompts/lease", json={"dataset": "prompts", "size": 10, "n": 1}).status_code == 403
    assert answer(alice, own_group(alice, version=1)) == (200, "accepted")
    s = p.stats()
    assert set(s["quarantined"]) == {"mallory"} and "replayed" in s["quarantined"]["mallory"]
    checks = s["participants"]["mallory"]["checks"]
    assert checks["failed"] == 5 and checks["by_check"] == {"unleased": 3, "reused": 1, "replayed": 1}, checks
    assert s["participants"]["alice"]["checks"]["failed"] == 0 and s["groups_held_out"] == 1
    assert metric(p, "proxy_participant_quarantined", check="replayed", participant="mallory") == 1
    assert metric(p, "proxy_participant_checks_failed", check="unleased", participant="mallory") == 3
    got = p.http.post("/v1/batches/lease", json={"num_groups": 3}).json()["groups"]  # all there is
    assert sorted(g.get("participant") or "admin" for g in got) == ["admin", "alice", "alice"]  # nothing of hers

    # the journal says why, and nothing of what was accepted is lost
    groups, events = journal(bucket)
    assert {g["group_id"] for g in groups} >= {honest["group_id"], mine["group_id"]}
    failed = [e for e in events if e["t"] == "failed"]
    assert [e["check"] for e in failed] == ["unleased"] * 3 + ["reused", "replayed"] and all(e["participant"] == "mallory" for e in failed)

    # a restart (SIGKILL: no snapshot on the way out) suspends exactly her, and the owner lets her back in
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()
    q = spawn("--quarantine-after", "5", token=p.token)
    mallory = as_(q, mallory.headers["x-proxy-token"])
    assert mallory.get("/v1/whoami").status_code == 403
    assert q.stats()["participants"]["mallory"]["checks"]["by_check"] == checks["by_check"]
    code, why = answer(mallory, own(group(version=1, lease_id=uuid.uuid4().hex, prompt_index=0)))
    assert code == 403 and "quarantined" in why
    env = {**os.environ, "PROXY_TOKEN": q.token}
    out = subprocess.run(["bash", str(ROOT / "launch_jobs.sh"), "--token-reinstate", "mallory", "--proxy-url", q.url],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "participant mallory reinstated" in out.stdout, out.stdout + out.stderr
    assert answer(mallory, own_group(mallory, version=1)) == (200, "accepted")
    assert "mallory" not in q.stats()["quarantined"] and q.stats()["participants"]["mallory"]["checks"]["failed"] == 0
    assert q.http.post("/v1/participants/mallory/reinstate").status_code == 409  # not quarantined: says so
    assert q.http.post("/v1/participants/nobody/reinstate").status_code == 404
    assert as_(q, create(q, "eve", "trainer")).post("/v1/participants/mallory/reinstate").status_code == 403
    # the prompt leases survived the restart too: the one she answered honestly stays answered
    code, why = answer(mallory, own({**mine, "group_id": uuid.uuid4().hex}))
    assert code == 409 and why.startswith("reused:"), why


def test_the_trainers_audit_report_counts_against_the_sender_as_the_proxy_recorded_it(bucket, spawn):
    p = spawn("--quarantine-after", "2")
    publish(bucket, p, 1)
    alice, bob = as_(p, create(p, "alice")), as_(p, create(p, "bob"))
    trainer = as_(p, create(p, "lab", "trainer"))
    sent = [own_group(alice, version=1), own_group(bob, version=1), own_group(bob, version=1), group(version=1)]
    for g, c in zip(sent, [alice, bob, bob, p.http]):
        assert answer(c, g) == (200, "accepted")
    got = trainer.post("/v1/batches/lease", json={"num_groups": 2}).json()  # alice's and one of bob's
    ids = [g["group_id"] for g in got["groups"]]
    report = lambda body, b=got["batch_id"]: trainer.post(f"/v1/batches/{b}/audit", json=body)  # noqa: E731
    # what is not a group of that batch, or is the admin's, is refused and changes nothing
    r = report({"checked": [sent[2]["group_id"]]})
    assert r.status_code == 422 and "not groups of batch" in r.text
    assert alice.post(f"/v1/batches/{got['batch_id']}/audit", json={"checked": ids}).status_code == 403
    r = report({"checked": ids, "failures": [{"group_id": ids[1], "check": "reward", "detail": "claims 1, is 0"}]})
    assert r.status_code == 200, r.text
    standing = r.json()["participants"]
    assert standing["alice"]["checked"] == 1 and standing["alice"]["failed"] == 0
    assert standing["bob"]["failed"] == 1 and standing["bob"]["quarantined"] is None
    assert p.http.post(f"/v1/batches/{got['batch_id']}/ack").status_code == 200
    got = trainer.post("/v1/batches/lease", json={"num_groups": 2}).json()  # bob's other one and the admin's
    bobs = next(g["group_id"] for g in got["groups"] if g.get("participant") == "bob")
    ours = next(g["group_id"] for g in got["groups"] if not g.get("participant"))
    r = report({"failures": [{"group_id": ours, "check": "reward", "detail": "x"}]}, got["batch_id"])
    assert r.status_code == 422 and "admin token" in r.text
    r = report({"checked": [bobs], "failures": [{"group_id": bobs, "check": "logprobs", "detail": "off by 0.7"}]}, got["batch_id"])
    assert r.json()["participants"]["bob"]["quarantined"]["check"] == "logprobs", r.text
    assert "off by 0.7" in p.stats()["quarantined"]["bob"] and bob.get("/v1/whoami").status_code == 403
    _, events = journal(bucket)
    assert [(e["check"], e["group_id"]) for e in events if e["t"] == "failed"] == [("reward", ids[1]), ("logprobs", bobs)]
    assert sum(e["counts"].get("alice", 0) for e in events if e["t"] == "checked") == 1


@pytest.mark.timeout(900)
def test_a_liar_beside_an_honest_worker_is_caught_every_way_and_quarantined(tiny_model, spawn, bucket, run_name, tmp_path):
    """The acceptance run on the tiny model: a real rollout worker on a participant's token (honest) and a
    participant that lies in each way in turn. Every lie caught and attributed to the liar, who is then
    quarantined; no honest group refused or left out; the audit's share of the trainer's own time printed."""
    from transformers import AutoTokenizer
    p = spawn("--max-buffer", "4", "--max-staleness", "3", "--quarantine-after", "7")
    guest, mallory = create(p, "guest"), create(p, "mallory")
    env = {k: v for k, v in os.environ.items()  # a participant's machine: no bucket, no keys
           if k not in ("BUCKET", "S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RUN_NAME")}
    env.update(PROXY_TOKEN=guest, OMP_NUM_THREADS="1", SPOOL_DIR=str(tmp_path / "spool"))
    log = open(tmp_path / "rollout.log", "w")
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--proxy-url", p.url, "--model", tiny_model,
                               "--group-size", "4", "--prompts-per-round", "2", "--max-new-tokens", "6",
                               "--worker-id", "laptop"], env=env, stdout=log, stderr=log)
    said, done = [], []
    liar = Worker(hostile, p.url, mallory, AutoTokenizer.from_pretrained(tiny_model), p, bucket, said, done)
    liar.start()
    try:
        train = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--model", tiny_model, "--max-steps", "100000",
                                  "--batch-groups", "2", "--lr", "1e-3", "--lease-wait-s", "5", "--no-skip-zero-std"],
                                 env={**os.environ, "RUN_NAME": run_name, "PROXY_URL": p.url, "PROXY_TOKEN": p.token,
                                      "OMP_NUM_THREADS": "1"}, stdout=open(tmp_path / "train.log", "w"), stderr=subprocess.STDOUT)
        # the trainer runs until the liar is done (stopped below; a bound on its steps could end it first: with 200,
        # a lie dropped stale in the buffer was made afresh after the trainer had finished, and waited for room)
        liar.join(timeout=600)
        assert done, "the liar did not finish: " + repr(said) + (tmp_path / "train.log").read_text()[-3000:]
    finally:
        stop(train)
        stop(worker)
    # the proxy's lies: a 409 naming each; the audit's: accepted, then caught by the trainer
    # (a replay of a group older than the proxy's fingerprint window, claimed as the latest version's, gets past
    # the proxy and is caught by the trainer's audit: its prompt is not the one leased, its logprobs not that version's)
    codes = {k: c for k, c, _ in said}
    by_proxy = codes["replayed"] == 409
    assert len(said) == 6 and codes["replayed"] in (409, 200), said
    assert codes == {"reward": 200, "prompt": 200, "logprobs": 200, "reused": 409, "unleased": 409,
                     "replayed": codes["replayed"]}, said
    assert all(t.split('"detail":"')[1].startswith(k) for k, c, t in said if c == 409), said
    s = p.stats()
    q = s["participants"]["mallory"]["checks"]
    want = {c: 1 for c in ("reward", "prompt", "logprobs", "unleased", "reused")}
    assert q["failed"] == 6 and all(q["by_check"].get(c, 0) >= n for c, n in want.items()), q
    assert q["by_check"].get("replayed", 0) == int(by_proxy), q
    assert s["participants"]["guest"]["checks"]["failed"] == 0 and "mallory" not in s["quarantined"]
    # one more failed check reaches --quarantine-after 7: quarantined, its token refused from then on
    r = httpx.post(f"{p.url}/v1/groups", headers={"x-proxy-token": mallory},
                   json={**group(version=s["latest_version"]), "lease_id": uuid.uuid4().hex, "prompt_index": 0})
    assert r.status_code == 409 and "now quarantined" in r.text, r.text
    assert httpx.get(f"{p.url}/v1/whoami", headers={"x-proxy-token": mallory}).status_code == 403
    _, events = journal(bucket)
    failed = [e for e in events if e["t"] == "failed"]
    assert all(e["participant"] == "mallory" for e in failed) and len(failed) == 7
    rows = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    audited = [r for r in rows if "audit/groups" in r]
    assert sum(r.get("audit/left_out", 0) for r in audited) == 3 + (not by_proxy)  # the lies the trainer caught; no honest group
    assert sum(r["audit/groups"] for r in audited) >= s["participants"]["guest"]["checks"]["checked"] > 8
    honest_max = max(r["audit/logprob_dev_max"] for r in audited if not r["audit/failed"])
    own = sum(r["perf/step_s"] - r["perf/rollout_wait_s"] for r in rows)
    # the policy's drift on the tiny model, per staleness: what --audit.max-drift (per version) must stay above; the
    # trained tokens are the honest worker's and the run's own, the lies having been left out
    drift = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("stale/") and k.endswith("/logp_dev_max"):
                drift[int(k.split("/")[1])] = max(drift.get(int(k.split("/")[1]), 0.0), v)
    print("largest |logprob - behaviour logprob| of a trained token by staleness: "
          + ", ".join(f"{lag}: {v:.3g}" for lag, v in sorted(drift.items())))
    print(f"audited {sum(r['audit/groups'] for r in audited)} groups in {len(rows)} steps; honest groups' largest "
          f"|logprob difference| {honest_max:.2e}; audit {sum(r.get('perf/audit_s', 0) for r in rows):.2f} s of "
          f"the trainer's own {own:.2f} s ({100 * sum(r.get('perf/audit_s', 0) for r in rows) / own:.1f}%)")


def test_the_audit_recomputes_logprobs_under_the_exact_version_that_sampled_them(tiny_model, seed):
    """The trainer's model and its audit (lib/train/audit.py), in process: groups sampled by the hf engine under
    version 1 pass once the model has moved on to version 2 (their logprobs are recomputed with version 1's
    LoRA tensors, the trainer's own weights restored bit for bit after), and so do groups of version 2 at once;
    made-up logprobs, an inflated reward and a prompt not the leased one each fail, naming why."""
    import torch

    import train
    from audit import Auditor, Options
    from hf_engine import sample
    from models import encode_prompt, lora_views
    torch.manual_seed(seed)
    args = train.Args(model=tiny_model)
    model, tok = train.build_model(args)
    auditor = Auditor(Options(), "addition", tok, None, None, 2, lambda g: 1.0, lambda g: True, say=lambda s: None)
    task = load_task("addition")  # the Task itself (auditor.task is how the audit checks it)

    def perturb():  # a step's worth of change to the LoRA: the next version
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.add_(torch.randn_like(p) * 0.05)

    def groups(version: int, n: int = 3) -> list[dict]:
        idx = [(seed + k) % len(task.prompts) for k in range(n)]
        prompts = [encode_prompt(tok, task.prompts[i]) for i in idx]
        with torch.no_grad():
            got = sample(model, prompts, 4, 8, 1.0, {tok.eos_token_id}, tok.eos_token_id)
        out = []
        for b, i in enumerate(idx):
            comps = [{"token_ids": ids, "logprobs": lps, "finish_reason": why,
                      "reward": task.reward(tok.decode(ids, skip_special_tokens=True), i)[0]}
                     for ids, lps, why in got[b * 4:(b + 1) * 4]]
            out.append({"group_id": f"g{version}-{b}", "policy_version": version, "prompt_ids": prompts[b],
                        "completions": comps, "participant": "p", "prompt_dataset": "addition", "prompt_index": i,
                        "lease_id": "l" * 8, "meta": {}})
        return out

    perturb()
    auditor.weights.remember(1, model)
    v1 = groups(1)
    perturb()
    auditor.weights.remember(2, model)
    v2 = groups(2)
    before = {k: t.clone() for k, t in lora_views(model).items()}
    devs, lost = auditor.recompute(model, v1 + v2, 2, fresh=True)
    assert lost == 0 and len(devs) == 6
    for gid, (s, mx, n) in devs.items():
        if gid.startswith("g2"):  # the weights we hold sampled them, and the step trains them: its forward judges them
            assert n == 0, (gid, n)
            continue
        assert n > 0 and auditor.deviation(s, mx, n) is None, (gid, s / n, mx)
        assert s / n < 1e-4 and mx < 1e-3, (gid, s / n, mx)  # the floor, far below the limits (1e-3, 0.05)
    devs = {}
    assert not judged_by_the_step(model, v2, train.Args(model=tiny_model, skip_zero_std=False), 2, auditor, devs)
    assert sorted(devs) == [0, 1, 2]
    assert all(torch.equal(before[k], t) for k, t in lora_views(model).items())
    # version 1's groups scored with the weights the model holds now (version 2) would fail: the version matters
    stale = auditor.recompute(model, [{**g, "policy_version": 2} for g in v1], 2, fresh=False)[0]
    assert all(auditor.deviation(*d) for d in stale.values()), stale

    made_up = {**v1[0], "completions": [{**c, "logprobs": [-0.05] * len(c["token_ids"])} for c in v1[0]["completions"]]}
    why = auditor.deviation(*auditor.recompute(model, [made_up], 2, fresh=True)[0][made_up["group_id"]])
    assert why and "differ from those recomputed under the version that sampled them" in why
    assert auditor.prompt_problem(v1[1]) is None and auditor.reward_problem(v1[1]) is None
    inflated = {**v1[1], "completions": [{**c, "reward": 1.0} for c in v1[1]["completions"]]}
    assert "claims reward 1" in auditor.reward_problem(inflated)
    other = (v1[1]["prompt_index"] + 1) % len(task.prompts)  # (the seed may have drawn the last prompt)
    off = {**v1[1], "prompt_ids": encode_prompt(tok, task.prompts[other])}
    assert "not the chat-formatted prompt" in auditor.prompt_problem(off)
    assert "this run's task is 'addition'" in auditor.prompt_problem({**v1[1], "prompt_dataset": "gsm8k"})


def test_a_restarted_trainer_still_audits_every_group_of_a_participant_that_failed_a_check(tiny_model, spawn, bucket,
                                                                                        run_name, tmp_path):
    """The trainer audits every group of a participant once it failed a check (and only a sampled share of the
    others' logprobs). A trainer started after that failure (a restart, a takeover) learns it from the proxy's
    standing, which the journal holds: with --audit.logprob-share 0 its made-up logprobs are caught all the same."""
    from transformers import AutoTokenizer

    from models import encode_prompt
    from tasks import load_task
    p = spawn("--quarantine-after", "10", "--max-staleness", "3")
    publish(bucket, p, 1)  # the trainer starts at version 1, not fresh: no group is checked in its forward for free
    bob = as_(p, create(p, "bob"))
    tok, task = AutoTokenizer.from_pretrained(tiny_model), load_task("addition")
    open_dataset(p, task.name, len(task.prompts))  # as the trainer does at its start: it starts below

    def bobs(inflate: bool) -> dict:
        got = bob.post("/v1/prompts/lease", json={"dataset": task.name, "size": len(task.prompts), "n": 1}).json()
        i, comps = got["indices"][0], []
        for k in range(4):
            ids = tok.encode(f"The answer is {k + 2}", add_special_tokens=False)
            r = 1.0 if inflate else task.reward(tok.decode(ids, skip_special_tokens=True), i)[0]
            comps.append({"token_ids": ids, "logprobs": [-0.05 - 0.01 * k - 0.001 * inflate] * len(ids), "reward": r,
                          "finish_reason": "stop"})  # each group's own logprobs: the same again would be a replay
        return {"group_id": uuid.uuid4().hex, "worker_id": "b1", "policy_version": 0, "lease_id": got["lease_id"],
                "prompt_index": i, "prompt_ids": encode_prompt(tok, task.prompts[i]), "completions": comps,
                "meta": {"temperature": 1.0}}

    # the trainer before this one caught bob's inflated rewards (its report, as train.py sends it)
    assert answer(bob, bobs(inflate=True)) == (200, "accepted")
    got = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()
    gid = got["groups"][0]["group_id"]
    r = p.http.post(f"/v1/batches/{got['batch_id']}/audit",
                    json={"checked": [gid], "failures": [{"group_id": gid, "check": "reward", "detail": "claims 1"}]})
    assert r.status_code == 200 and r.json()["participants"]["bob"]["failed"] == 1, r.text
    assert p.http.post(f"/v1/batches/{got['batch_id']}/ack").status_code == 200
    # then a group with honest rewards and made-up logprobs, for a trainer that samples no one's logprobs
    assert answer(bob, bobs(inflate=False)) == (200, "accepted")
    failed = lambda: p.stats()["participants"]["bob"]["checks"]["by_check"]  # noqa: E731
    log = tmp_path / "train.log"
    train = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--model", tiny_model, "--max-steps", "1",
                              "--batch-groups", "1", "--lease-wait-s", "2", "--no-skip-zero-std",
                              "--audit.logprob-share", "0"],
                             env={**os.environ, "RUN_NAME": run_name, "PROXY_URL": p.url, "PROXY_TOKEN": p.token,
                                  "OMP_NUM_THREADS": "1"}, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:  # caught: bob's second failure; not caught: the trainer trains on it, finishes its one step and exits
        wait_for(lambda: "logprobs" in failed() or train.poll() is not None, 240, every=0.5, msg="the trainer's audit")
    finally:
        stop(train)
    assert failed() == {"reward": 1, "logprobs": 1}, log.read_text()[-3000:]
    assert "every group of bob is audited" in log.read_text()


def test_the_logprob_audit_draws_among_the_groups_the_step_trains_and_takes_every_group_of_a_suspect(tiny_model):
    """What the audit's forward is spent on: the logprobs of groups the step trains (those of a group it leaves out,
    rewards all equal, steer nothing), drawn at --audit.logprob-share; once a participant failed a check, every
    group of its, trained or not."""
    import train
    from audit import Auditor, Options
    from models import encode_prompt
    model, tok = train.build_model(train.Args(model=tiny_model))
    trains = {"a0", "b0"}
    proxy = AuditReports()
    auditor = Auditor(Options(logprob_share=1.0), "addition", tok, None, proxy, 2, lambda g: 1.0,
                      lambda g: g["group_id"] in trains, say=lambda s: None)
    task = load_task("addition")  # the Task itself (auditor.task is how the audit checks it)

    def made_up(gid: str, i: int) -> dict:  # the right prompt, honest rewards, logprobs nobody computed
        ids = tok.encode(f"The answer is {i}", add_special_tokens=False)
        r = task.reward(tok.decode(ids, skip_special_tokens=True), i)[0]
        return {"group_id": gid, "policy_version": 0, "prompt_ids": encode_prompt(tok, task.prompts[i]),
                "participant": "p", "prompt_dataset": "addition", "prompt_index": i, "lease_id": "l" * 8, "meta": {},
                "completions": [{"token_ids": ids, "logprobs": [-0.05] * len(ids), "reward": r, "finish_reason": "stop"}] * 4}

    kept, row = auditor.check({"batch_id": "b1"}, [made_up("a0", 1), made_up("a1", 2)], model, 1, fresh=False)
    assert row["audit/logprob_groups"] == 1 and row["audit/failed_logprobs"] == 1, row  # a0's, the one trained
    assert [g["group_id"] for g in kept] == ["a1"] and auditor.suspects == {"p"}
    kept, row = auditor.check({"batch_id": "b2"}, [made_up("b0", 1), made_up("b1", 2)], model, 1, fresh=False)
    assert row["audit/logprob_groups"] == 2 and row["audit/failed_logprobs"] == 2 and not kept, row  # a suspect: all
    assert [(path, [f["group_id"] for f in body["failures"]]) for path, body in proxy.sent] == [
        ("/v1/batches/b1/audit", ["a0"]), ("/v1/batches/b2/audit", ["b0", "b1"])]


@pytest.mark.parametrize("arrive", ["decode", "prefill"])
def test_a_group_a_worker_finished_with_a_newer_version_is_audited_under_each_of_its_versions(
        tiny_model, start_proxy, bucket, run_name, tmp_path, monkeypatch, arrive):
    """A real worker on participant guest's token took version 2 during its round (tests/support/swapping.py: at a
    decode step, or during the prefill). The audit's own decision (Auditor.check, the trainer holding version 2,
    --audit.logprob-share 1) recomputes the version-1 tokens under version 1's weights and leaves the version-2
    tokens to the step's own forward (Auditor.judge, at the audit's limits there): honest, both pass. Made up on
    version 1's tokens only (0.01 nats: above the mean limit, far within the drift bound), only the recompute
    catches it; made up at version 1's last token only, the recompute (each completion up to there) catches it;
    made up on version 2's tokens, only the step's forward does. A round whose prefill took version 2 is all version
    2's: checked in the step's forward, nothing recomputed."""
    from transformers import AutoTokenizer

    import train
    from audit import Auditor, Options
    from common import token_versions
    from swapping import swap_round, versions
    monkeypatch.setenv("RUN_NAME", run_name)
    p = start_proxy("--group-size", "4", "--max-staleness", "3")
    guest, task = create(p, "guest"), load_task("addition")
    open_dataset(p, task.name, len(task.prompts))  # as the trainer does at its start
    models = versions(tiny_model, tmp_path, bucket, p)
    groups, swaps = swap_round(tiny_model, p, guest, tmp_path, models, arrive)
    assert all(g["participant"] == "guest" and g["prompt_dataset"] == "addition" for g in groups)
    tok, args, trainer = AutoTokenizer.from_pretrained(tiny_model), train.Args(model=tiny_model, skip_zero_std=False), models[2]

    def audit(gs: list[dict]) -> tuple[list[str], dict]:
        auditor = Auditor(Options(logprob_share=1.0), "addition", tok, None, AuditReports(), 2, lambda g: 1.0,
                          lambda g: True, say=lambda s: None)
        for v, m in models.items():
            auditor.weights.remember(v, m)
        kept, row = auditor.check({"batch_id": "b"}, gs, trainer, 2, fresh=True)
        return [g["group_id"] for g in kept], {**row, "judged": kept and judged_by_the_step(trainer, kept, args, 2, auditor)}

    def made_up(g: dict, version: int, last_only: bool = False) -> dict:
        comps = []
        for c in g["completions"]:
            mine = [t for t, v in enumerate(token_versions(c, g["policy_version"])) if v == version]
            lie = mine[-1:] if last_only else mine
            comps.append({**c, "logprobs": [x - (0.1 if last_only else 0.01) if t in lie else x
                                            for t, x in enumerate(c["logprobs"])]})
        return {**g, "group_id": f"{g['group_id']}-{version}{'-last' * last_only}", "completions": comps}

    kept, row = audit(groups)
    assert len(kept) == 2 and row["audit/failed"] == 0 and not row["judged"], row
    if arrive == "prefill":  # every token version 2's: the step's forward checks them all, nothing to recompute
        assert swaps == [] and row["audit/onpolicy_groups"] == 2 and row["audit/logprob_groups"] == 0, (swaps, row)
        lie = made_up(groups[0], 2)
        kept, row = audit([lie])
        assert kept == [lie["group_id"]] and set(row["judged"]) == {lie["group_id"]}, row
        return
    # begun with version 1: its version-1 tokens recomputed by the audit's own decision, never taken as on-policy
    assert swaps and row["audit/onpolicy_groups"] == 0 and row["audit/logprob_groups"] == 2, (swaps, row)
    for lie in (made_up(groups[0], 1), made_up(groups[0], 1, last_only=True)):
        kept, row = audit([lie])
        assert kept == [] and row["audit/failed_logprobs"] == 1, (lie["group_id"], row)
    auditor = Auditor(Options(), "addition", tok, None, AuditReports(), 2, lambda g: 1.0, lambda g: True)
    assert not judged_by_the_step(trainer, [made_up(groups[0], 1)], args, 2, auditor)  # the step's forward passes it
    lie = made_up(groups[0], 2)
    kept, row = audit([lie])
    assert kept == [lie["group_id"]] and row["audit/failed"] == 0 and set(row["judged"]) == {lie["group_id"]}, row


def test_the_logprob_limits_follow_the_dtype_the_trainer_computes_in():
    """--audit.max-dev-* not given: float32's limits in float32, wider ones in 16 bits (a bf16 engine's floor on an
    H200, 4.6e-3 mean and 0.025 a token, is above float32's 1e-3: every honest group of a bf16 worker would fail);
    given, they stand whatever the dtype. The Auditor applies them."""
    import torch

    from audit import Auditor, Options, with_limits
    assert (with_limits(Options(), torch.float32).max_dev_mean, with_limits(Options(), torch.float32).max_dev_token) == (1e-3, 0.05)
    bf16 = with_limits(Options(), torch.bfloat16)
    assert bf16.max_dev_mean == 2.5e-2 > 4 * 5.1e-3 and bf16.max_dev_token == 0.1 >= 4 * 0.025
    mine = with_limits(Options(max_dev_mean=3e-3, max_dev_token=0.2), torch.bfloat16)
    assert (mine.max_dev_mean, mine.max_dev_token) == (3e-3, 0.2)
    auditor = Auditor(Options(), "addition", None, None, None, 2, lambda g: 1.0, lambda g: True, say=lambda s: None,
                      dtype=torch.bfloat16)
    assert (auditor.opts.max_dev_mean, auditor.opts.max_dev_token) == (2.5e-2, 0.1)


@pytest.mark.timeout(600)
def test_a_quarantined_rollout_worker_stops_with_one_line_naming_the_quarantine(tiny_model, spawn, bucket, tmp_path):
    """A real rollout.py on participant guest's token, quarantined while it runs (a lie sent under its name: the
    proxy's --quarantine-after 1): it stops with one line that names the quarantine, its reason and how the run's
    owner lifts it, and a non-zero exit status; no traceback; what it had spooled stays on its disk."""
    p = spawn("--quarantine-after", "1")
    guest = create(p, "guest")
    addition = load_task("addition")
    open_dataset(p, addition.name, len(addition.prompts))  # as the trainer does at its start
    env = {k: v for k, v in os.environ.items()  # a participant's machine: no bucket, no keys
           if k not in ("BUCKET", "S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RUN_NAME")}
    env.update(PROXY_TOKEN=guest, OMP_NUM_THREADS="1", SPOOL_DIR=str(tmp_path / "spool"))
    log = tmp_path / "rollout.log"
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--proxy-url", p.url, "--model", tiny_model,
                               "--group-size", "4", "--prompts-per-round", "2", "--max-new-tokens", "6",
                               "--worker-id", "laptop"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: p.stats()["participants"].get("guest", {}).get("groups", 0) >= 2 or worker.poll() is not None,
                 300, msg="the worker's first round")
        assert worker.poll() is None, log.read_text()[-3000:]
        code, why = answer(as_(p, guest), own(group(lease_id=uuid.uuid4().hex, prompt_index=0)))
        assert code == 409 and "now quarantined" in why, why
        worker.wait(timeout=120)
    finally:
        stop(worker)
    text = log.read_text()
    assert worker.returncode == 3 and "Traceback" not in text, text[-3000:]  # rollout.EXIT_REFUSED
    said = [line for line in text.splitlines() if "quarantined" in line]
    assert len(said) == 1, text[-3000:]
    assert ("participant 'guest' is quarantined: 1 failed checks (limit 1); the last: unleased:" in said[0]
            and "bash launch_jobs.sh --token-reinstate guest" in said[0]
            and "POST /v1/participants/guest/reinstate" in said[0]), said[0]
    # the groups the proxy refused with the token (not judged) stay spooled, none set aside as refused
    spool = next((tmp_path / "spool").iterdir()) / "laptop"
    kept = sorted(spool.glob("*.json"))
    assert f"{len(kept)} group(s) stay spooled in {spool}" in said[0] and not list((spool / "refused").iterdir()), said[0]
