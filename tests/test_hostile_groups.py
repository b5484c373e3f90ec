"""One group must not end or destroy a run (issue #44). Each row of the issue's table twice: at the door (the real
proxy refuses it with a 422 naming the field and why) and in the trainer (a group that got past the door, as one the
journal holds from before a rule would: the trainer's own functions on a batch the real proxy leased leave it out,
count it against its sender, and train on the rest; nothing non-finite is stepped on or published)."""
import math
import uuid

import pytest
import torch

from conftest import stop
from proxyproc import spawn  # noqa: F401 - a fixture
from test_proxy_access import as_, create, leased
from test_train_step import _group

# the issue's rows 1-5: what one group carries, how it is made from an honest one, and the 422's words
ROWS = {
    "1 timings": (lambda g: g["meta"].update(timings="x"), "meta.timings"),
    "1 reward_components": (lambda g: g["meta"].update(reward_components=[1]), "meta.reward_components"),
    "2 temperature 1e-300": (lambda g: g["meta"].update(temperature=1e-300), "meta.temperature"),
    "3 temperature 1e-39": (lambda g: g["meta"].update(temperature=1e-39), "meta.temperature"),
    "4 logprob -100": (lambda g: [c.update(logprobs=[-100.0] * len(c["logprobs"])) for c in g["completions"]],
                       "greater than or equal to -50"),
    "5 token id past the vocabulary": (lambda g: g["completions"][0]["token_ids"].__setitem__(0, 49152),
                                       "token id 49152 is not below the model's vocabulary size 49152"),
}


@pytest.fixture(scope="module")
def model(tiny_model):
    import train
    torch.manual_seed(0)
    return train.build_model(train.Args(model=tiny_model))


def honest(model, seed: int, client=None) -> dict:
    """A group of the tiny model's own logprobs (test_train_step._group), answering a prompt `client` leased."""
    g = _group(model[0], seed, [1.0, 0.0, 0.0, 1.0])
    g["group_id"] = uuid.uuid4().hex
    g["meta"].update(timings={"gen_s": 0.5}, reward_components={"correct": 0.5})
    return {**g, **(leased(client)[0] if client is not None else {})}


def detail(r) -> str:
    d = r.json()["detail"]
    return d if isinstance(d, str) else " ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in d)


@pytest.mark.parametrize("row", ROWS)
def test_the_proxy_refuses_each_hostile_group_naming_why(model, spawn, row):
    p = spawn()
    alice = as_(p, create(p, "alice"))
    bad = honest(model, 1, alice)
    ROWS[row][0](bad)
    r = alice.post("/v1/groups", json=bad)
    assert r.status_code == 422 and ROWS[row][1] in detail(r), (r.status_code, r.text)
    assert alice.post("/v1/groups", json=honest(model, 2, alice)).json()["status"] == "accepted"
    assert p.stats()["buffer_size"] == 1


def test_a_participant_may_claim_only_the_runs_sampling_temperature(model, spawn):
    """The claimed temperature is a gradient weight (the trainer scores a group at meta.temperature, ~1/T): a group
    sampled and reported honestly at T = 0.1 (its logprobs the tiny model's own at 0.1) is refused at the door,
    naming the field and the temperatures the run takes (--temperatures, the workers' own); at the run's temperature
    the same prompt is taken. The run's own groups are not held to it; a proxy told of several takes each."""
    p = spawn()
    alice = as_(p, create(p, "alice"))
    cold = {**_group(model[0], 5, [1.0, 0.0, 0.0, 1.0], T=0.1), "group_id": uuid.uuid4().hex, **leased(alice)[0]}
    r = alice.post("/v1/groups", json=cold)
    assert r.status_code == 422 and detail(r) == (
        "meta.temperature: 0.1 is not this run's sampling temperature: it takes 1.0 (--temperatures; the trainer "
        "weighs a group's gradient by its temperature)"), r.text
    assert p.stats()["buffer_size"] == 0 and p.stats()["participants"]["alice"]["checks"]["failed"] == 0
    honest_ = {**_group(model[0], 5, [1.0, 0.0, 0.0, 1.0], T=1.0), "group_id": uuid.uuid4().hex,
               **{k: cold[k] for k in ("lease_id", "prompt_index")}}
    assert alice.post("/v1/groups", json=honest_).json()["status"] == "accepted"  # (the prompt refused is not used up)
    ours = {**cold, "group_id": uuid.uuid4().hex}
    del ours["lease_id"], ours["prompt_index"]
    assert p.http.post("/v1/groups", json=ours).json()["status"] == "accepted"
    stop(p.proc)
    q = spawn("--temperatures", "0.7", "1.0", token=p.token)  # the same run, restarted
    alice = as_(q, alice.headers["x-proxy-token"])
    for t, code in [(0.7, 200), (1.0, 200), (0.1, 422)]:
        g = {**_group(model[0], 6, [1.0, 0.0, 0.0, 1.0], T=t), "group_id": uuid.uuid4().hex, **leased(alice)[0]}
        r = alice.post("/v1/groups", json=g)
        assert r.status_code == code and (code == 200 or "it takes 0.7 or 1.0" in detail(r)), (t, r.text)


def trainer(tiny_model, p, model, loss: str):
    """train.Trainer as train.start builds it, on the module's model, reporting to the real proxy `p`; the audit's own
    checks off (these groups answer no prompt of a task), its screen and reports as ever."""
    import train
    from audit import Auditor, Options
    from proxy_client import ProxyClient
    args = train.Args(model=tiny_model, loss=loss, skip_zero_std=False, micro_groups=2)
    m, tok = model
    client = ProxyClient(p.url, p.token)
    auditor = Auditor(Options(enabled=False), "addition", tok, None, client, 2, lambda g: 1.0, lambda g: True)
    params = [q for q in m.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    vocab = min(m.get_input_embeddings().weight.shape[0], m.get_output_embeddings().weight.shape[0])
    return train.Trainer(args, None, client, None, None, m, params, opt, sched, auditor, vocab, None, None, None,
                         step=0, version=1, since_publish=1, checkpointed=0)


def leased_batch(p, model, alice, make_bad) -> tuple[dict, str]:
    """A batch the real proxy leased: an honest group of alice's and one that breaks a rule (made so after the lease,
    as the journal of an older proxy could hold it). Returns the batch and the bad group's id."""
    for seed in (3, 4):
        assert alice.post("/v1/groups", json=honest(model, seed, alice)).json()["status"] == "accepted"
    got = p.http.post("/v1/batches/lease", json={"num_groups": 2}).json()
    make_bad(got["groups"][1])
    got["fresh"] = got["groups"]
    return got, got["groups"][1]["group_id"]


def finite(m) -> bool:
    return all(torch.isfinite(q).all() for q in m.parameters() if q.requires_grad)


@pytest.mark.parametrize("row", ROWS)
def test_the_trainer_leaves_out_a_hostile_group_counts_it_and_trains_on(tiny_model, model, spawn, row):
    import train
    p = spawn()
    alice = as_(p, create(p, "alice"))
    t = trainer(tiny_model, p, model, "ppo")
    got, bad = leased_batch(p, model, alice, ROWS[row][0])
    before = {n: q.detach().clone() for n, q in model[0].named_parameters() if q.requires_grad}
    got["fresh"], got["audit"] = t.audit(got)
    assert [g["group_id"] for g in got["fresh"]] == [got["groups"][0]["group_id"]] and got["audit"]["groups/invalid"] == 1
    st, norm = train.learn(t, got)
    assert st["groups/trained"] == 1 and math.isfinite(norm) and finite(model[0])
    assert any(not torch.equal(before[n], q) for n, q in model[0].named_parameters() if q.requires_grad)
    assert train.batch_metrics(got["fresh"], 1)["reward/mean"] == 0.5
    checks = p.stats()["participants"]["alice"]["checks"]
    assert checks["by_check"] == {"invalid": 1} and checks["recent"][0]["group_id"] == bad, checks


@pytest.mark.parametrize("row", ["4 logprob -100", "5 token id past the vocabulary"])
def test_a_group_the_screen_missed_is_found_by_the_step_and_no_nonfinite_update_is_made(tiny_model, model, spawn, row):
    """Past every rule (the screen skipped): the step itself finds the group whose values make it raise (an id past
    the embedding) or its loss non-finite (a ratio of exp(100) under ppo), leaves it out, counts it, trains on the
    rest; the weights stay finite."""
    import train
    p = spawn()
    alice = as_(p, create(p, "alice"))
    t = trainer(tiny_model, p, model, "ppo")
    got, bad = leased_batch(p, model, alice, ROWS[row][0])
    got["audit"] = {}
    st, norm = train.learn(t, got)
    assert st["groups/trained"] == 1 and st["groups/unfit"] == 1 and math.isfinite(norm) and finite(model[0]), st
    assert p.stats()["participants"]["alice"]["checks"]["by_check"] == {"invalid": 1}
    # the same group alone: no update at all, the weights untouched and finite
    before = {n: q.detach().clone() for n, q in model[0].named_parameters() if q.requires_grad}
    got, _ = leased_batch(p, model, alice, ROWS[row][0])
    got["fresh"], got["audit"] = [got["groups"][1]], {}
    st, _ = train.learn(t, got)
    assert st["groups/trained"] == 0 and all(torch.equal(before[n], q) for n, q in model[0].named_parameters()
                                             if q.requires_grad)


def lease(client, dataset: str = "addition", size: int = 500, n: int = 1, **paced):
    return client.post("/v1/prompts/lease", json={"dataset": dataset, "size": size, "n": n, **paced})


def test_row_6_a_participant_cannot_set_the_size_of_the_runs_dataset(spawn):
    """Only the run's owner opens a dataset (the trainer its task's, at its start); a participant's lease before that
    waits, and once it is open a lease of another size, or of more prompts than it has, is refused. Across a restart."""
    import os
    import signal
    p = spawn()
    mallory, alice = as_(p, create(p, "mallory")), as_(p, create(p, "alice"))
    r = lease(mallory, size=5)
    assert r.status_code == 503 and "dataset 'addition' is not open in this run yet" in r.text, r.text
    assert r.headers["retry-after"] and "addition" not in p.stats()["cursors"]
    assert mallory.post("/v1/prompts/datasets", json={"dataset": "addition", "size": 5}).status_code == 403
    # an honest worker that asks for a grant before the trainer started is told to wait, not refused
    r = lease(alice, size=500, n=2, worker_id="w1", wait_s=0.5)
    assert r.status_code == 200 and r.json()["indices"] == [] and "not open" in r.json()["not_open"], r.text
    trainer = as_(p, create(p, "lab", "trainer"))
    assert trainer.post("/v1/prompts/datasets", json={"dataset": "addition", "size": 500}).json()["opened"] is True
    assert trainer.post("/v1/prompts/datasets", json={"dataset": "addition", "size": 500}).json()["opened"] is False
    r = trainer.post("/v1/prompts/datasets", json={"dataset": "addition", "size": 501})
    assert r.status_code == 409 and "has size 500 in this run, not 501" in r.text
    assert len(lease(alice, size=500, n=2, worker_id="w1", wait_s=5).json()["indices"]) == 2
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait()
    q = spawn(token=p.token)
    mallory = as_(q, mallory.headers["x-proxy-token"])
    r = lease(mallory, size=5)
    assert r.status_code == 409 and "dataset 'addition' has size 500 in this run, not 5" in r.text, r.text
    r = lease(mallory, size=500, n=501)
    assert r.status_code == 409 and "n 501 is more than dataset 'addition''s 500 prompts" in r.text, r.text
    assert lease(as_(q, alice.headers["x-proxy-token"]), size=500).status_code == 200


def test_row_7_made_up_dataset_names_take_no_room_from_the_runs(spawn):
    p = spawn()
    mallory, trainer = as_(p, create(p, "mallory")), as_(p, create(p, "lab", "trainer"))
    for i in range(64):
        r = lease(mallory, dataset=f"made-up-{i}", size=10)
        assert r.status_code == 503 and "is not open in this run yet" in r.text, r.text
    assert set(p.stats()["cursors"]) == {"prompts"}  # the tests' own, opened by the owner (create)
    assert trainer.post("/v1/prompts/datasets", json={"dataset": "addition", "size": 500}).status_code == 200
    assert lease(mallory, size=500).status_code == 200


def test_prompt_choice_a_leased_prompt_is_answered_once_per_lease(spawn):
    """The issue's attack: a lease answered 20 times for one prompt (all 20 were taken). A participant's lease holds
    each prompt once, also where it runs into the next epoch (the prompts it holds already are left out), and each
    is answered by one group: the other 19 are refused (409 naming the index and the lease, nothing of them taken,
    each counted). The same group sent again (a spool's resend after a lost answer) is a duplicate, not a lie."""
    from test_proxy import group
    from test_proxy_access import own
    p = spawn("--quarantine-after", "100")
    mallory, trainer = as_(p, create(p, "mallory")), as_(p, create(p, "lab", "trainer"))
    assert trainer.post("/v1/prompts/datasets", json={"dataset": "d80", "size": 80}).status_code == 200
    assert len(lease(mallory, dataset="d80", size=80, n=30).json()["indices"]) == 30
    got = lease(mallory, dataset="d80", size=80, n=80).json()  # 50 of epoch 0, then epoch 1 up to 80 prompts
    idx, epochs = got["indices"], got["epochs"]
    assert len(set(idx)) == len(idx) == len(epochs) and epochs[:50] == [0] * 50 and set(epochs[50:]) <= {1}, got
    assert len(idx) < 80  # (a seeded shuffle: epoch 1's first 30 meet some of epoch 0's last 50)
    target = idx[-1]
    answers = [mallory.post("/v1/groups", json=own(group(lease_id=got["lease_id"], prompt_index=target, worker="m1")))
               for _ in range(20)]
    assert [r.status_code for r in answers].count(200) == 1 and answers[0].json()["status"] == "accepted"
    first = answers[0].request.content
    for r in answers[1:]:
        assert r.status_code == 409 and r.json()["detail"].startswith(
            f"reused: prompt index {target} of lease {got['lease_id']} was answered already, by group ") \
            and r.json()["detail"].endswith("; counted against this participant"), r.text
    assert mallory.post("/v1/groups", content=first, headers={"content-type": "application/json"}).json()["status"] == "duplicate"
    s = p.stats()
    assert s["buffer_size"] == 1 and s["participants"]["mallory"]["checks"]["by_check"] == {"reused": 19}, s


def test_the_steps_own_forward_leaves_out_a_group_far_off_its_logprobs_before_its_loss(tiny_model, model, spawn):
    """Row 4 past every rule (the screen skipped), with the audit on: the step's own forward judges every token it
    trains (Auditor.judge) and leaves the group out before its loss is formed, |logprob - behaviour| being ~100 nats
    per version of staleness where --audit.max-drift allows common.MAX_DRIFT: counted as a failed `logprobs` check,
    no group trained alone to find it, the step not taken again, the update made of the rest, finite."""
    import train
    from audit import Auditor, Options
    p = spawn()
    alice = as_(p, create(p, "alice"))
    t = trainer(tiny_model, p, model, "ppo")
    t.auditor = Auditor(Options(), "addition", model[1], None, t.client, 2, lambda g: 1.0, lambda g: True)
    got, bad = leased_batch(p, model, alice, ROWS["4 logprob -100"][0])
    got["audit"] = {}
    st, norm = train.learn(t, got)
    assert st["groups/trained"] == 1 and "groups/unfit" not in st and math.isfinite(norm) and finite(model[0]), st
    assert got["audit"] == {"audit/failed": 1, "audit/failed_logprobs": 1, "audit/left_out": 1}, got["audit"]
    checks = p.stats()["participants"]["alice"]["checks"]
    assert checks["by_check"] == {"logprobs": 1} and checks["recent"][0]["group_id"] == bad, checks
    assert "per version of staleness" in checks["recent"][0]["detail"], checks


def test_a_participant_the_steps_judgement_quarantines_has_none_of_its_groups_in_the_update(tiny_model, model, spawn):
    """The same group, its sender's first failed check past --quarantine-after 1: the report quarantines alice, and
    her honest group, which the update already held, is taken out by taking the step again without it (audit/redone):
    the update holds none of hers; the model is what it was before the step."""
    import train
    from audit import Auditor, Options
    p = spawn("--quarantine-after", "1")
    alice = as_(p, create(p, "alice"))
    t = trainer(tiny_model, p, model, "ppo")
    t.auditor = Auditor(Options(), "addition", model[1], None, t.client, 2, lambda g: 1.0, lambda g: True)
    got, bad = leased_batch(p, model, alice, ROWS["4 logprob -100"][0])
    got["audit"] = {}
    before = {n: q.detach().clone() for n, q in model[0].named_parameters() if q.requires_grad}
    st, norm = train.learn(t, got)
    assert st["groups/trained"] == 0 and got["audit"]["audit/redone"] == 1 and got["audit"]["audit/left_out"] == 2, (st, got)
    assert all(torch.equal(before[n], q) for n, q in model[0].named_parameters() if q.requires_grad)
    assert "alice" in p.stats()["quarantined"]
