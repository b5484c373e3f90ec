"""Episodes: a completion is the token sequence after the group's prompt with a per-token mask (1: sampled
by the policy, with its behaviour logprob and the version that sampled it; 0: put there by an environment,
a tool or the chat template). Inconsistent episodes are refused with a clear 4xx and nothing journaled; a
journal written before episodes existed replays; and the trainer's gradient comes only from the sampled
tokens, with the ratio 1 on-policy, for every objective, with activation checkpointing on and off."""
import json
import time

import pytest
import torch
from pydantic import ValidationError

import common
import journal
import train
from test_proxy import group, publish
from test_train_step import _behaviour, _perturb

# an episode of 7 tokens: the model's turn (2), a tool's answer (3), the model's last turn (2)
MASK = [1, 1, 0, 0, 0, 1, 1]


def episode(**over) -> dict:
    c = {"token_ids": [11, 12, 13, 14, 15, 16, 17], "logprobs": [-0.5, -0.4, None, None, None, -0.3, -0.2],
         "mask": list(MASK), "reward": 1.0, "finish_reason": "stop"}
    return {**c, **over}


def parse(g: dict) -> common.TrajectoryGroup:
    return common.TrajectoryGroup.model_validate_json(json.dumps(g), strict=True)


# ---- the schema ---------------------------------------------------------------------------------

BAD = [  # (what is wrong, the completion's fields, words the error must say)
    ("mask of another length", {"mask": MASK[:-1]}, "7 token_ids but 6 mask entries"),
    ("a logprob where the mask is 0", {"logprobs": [-0.5, -0.4, -1.0, None, None, -0.3, -0.2]}, "token 2: mask 0"),
    ("no logprob where the mask is 1", {"logprobs": [-0.5, None, None, None, None, -0.3, -0.2]}, "token 1: mask 1"),
    ("no sampled token", {"mask": [0] * 7, "logprobs": [None] * 7}, "no token of this episode was sampled"),
    ("a null logprob without a mask", {"mask": None}, "there is no mask"),
    ("a mask value other than 0 and 1", {"mask": [1, 1, 2, 0, 0, 1, 1]}, "Input should be 0 or 1"),
    ("versions not starting at 0", {"versions": [[1, 0]]}, "must start at 0"),
    ("versions out of order", {"versions": [[0, 0], [5, 1], [3, 1]]}, "must start at 0, increase"),
    ("versions past the end", {"versions": [[0, 0], [7, 1]]}, "stay below the 7 tokens"),
]


@pytest.mark.parametrize("what,fields,says", BAD, ids=[b[0] for b in BAD])
def test_an_inconsistent_episode_is_refused_saying_what_is_wrong(what, fields, says):
    with pytest.raises(ValidationError, match=says.replace(".", r"\.")):
        parse(group(completions=[episode(**fields)] * 4))


def test_a_single_turn_group_is_an_episode_of_one_turn():
    g = parse(group())  # as every worker sent them before episodes: no mask, no versions
    assert g.completions[0].mask is None and g.newest_version() == 0
    assert common.token_versions(g.completions[0].model_dump(), 3) == [3, 3]


def test_versions_name_the_oldest_and_the_newest_and_every_tokens_own():
    c = episode(versions=[[0, 2], [5, 3]])
    g = parse(group(version=2, completions=[c] * 4))
    assert g.newest_version() == 3 and common.token_versions(c, 2) == [2, 2, 2, 2, 2, 3, 3]
    with pytest.raises(ValidationError, match="policy_version 1 is not the oldest version of its tokens"):
        parse(group(version=1, completions=[c] * 4))


# ---- the proxy ----------------------------------------------------------------------------------

def journaled(bucket) -> int:
    return sum(blob.count(b'{"group_id"') for _, blob in journal.read_objects(bucket, journal.log_keys(bucket)))


def test_a_group_says_the_sampling_its_library_used_and_averages_components_over_the_episodes_that_have_them():
    """An environment library's own loop (verifiers) may sample at another temperature than --temperature: the group
    says the one its episodes were sampled at (the trainer scores it at it) and each episode's sampling; a reward
    component some episodes lack (a metric recorded only sometimes) is the mean over those that have it. The proxy's
    schema takes the result."""
    import rollout
    from env_types import Session
    from episodes import Episode, group_sampling
    from tasks import load_task
    eps = [Episode(5, Session(), tokens=c["token_ids"], mask=c["mask"], logprobs=c["logprobs"], finish="stop",
                   sampling={"temperature": 0.7, "top_p": 1.0}) for c in (episode(), episode())]
    parts = [{"correct": 1.0, "diag_guesses": 3.0}, {"correct": 0.0}]
    comps = [e.completion(r) for e, r in zip(eps, (1.0, 0.0))]
    g = rollout.group_record(rollout.Args(temperature=1.0), load_task("addition"), 0, "lease-0001", 5, [1, 2, 3],
                             comps, parts, {}, group_sampling(eps))
    meta = parse(g).meta
    assert meta["temperature"] == 0.7 and meta["sampling"] == [{"temperature": 0.7, "top_p": 1.0}] * 2
    assert meta["reward_components"] == {"correct": 0.5, "diag_guesses": 3.0}
    assert group_sampling([Episode(5, Session())]) == {}  # the worker's own runner: --temperature, said as before
    g = rollout.group_record(rollout.Args(temperature=1.0), load_task("addition"), 0, "lease-0001", 5, [1, 2, 3],
                             comps, parts, {})
    assert parse(g).meta["temperature"] == 1.0 and "sampling" not in g["meta"]


def test_the_proxy_refuses_bad_episodes_and_keeps_good_ones_as_sent(start_proxy, bucket):
    p = start_proxy("--group-size", "4", "--max-completion-tokens", "16")
    publish(bucket, p, 1)
    for what, fields, says in BAD:
        r = p.http.post("/v1/groups", json=group(version=1, completions=[episode(**fields)] * 4))
        assert r.status_code == 422 and says.split(":")[0] in r.text, (what, r.text)
    r = p.http.post("/v1/groups", json=group(version=1, completions=[episode(token_ids=[5] * 17, logprobs=[-1.0] * 17,
                                                                             mask=[1] * 17)] * 4))
    assert r.status_code == 422 and "17 tokens > max_completion_tokens 16" in r.text
    r = p.http.post("/v1/groups", json=group(version=1, completions=[episode(versions=[[0, 1], [5, 2]])] * 4))
    assert r.status_code == 409 and "a token of version 2 is newer than the latest registered 1" in r.text
    assert p.stats()["groups_accepted"] == 0 and journaled(bucket) == 0  # nothing of them is in the journal

    good = group(version=0, completions=[episode(versions=[[0, 0], [5, 1]])] * 4)
    assert p.http.post("/v1/groups", json=good).json()["status"] == "accepted"
    got = p.http.post("/v1/batches/lease", json={"num_groups": 1}).json()["groups"][0]
    assert got["completions"] == good["completions"] and journaled(bucket) == 1


def test_a_journal_of_single_turn_groups_replays(start_proxy, bucket):
    """A commit object whose group lines have no mask or versions (single-turn groups, as a worker sends them): a
    proxy starts from it, leases the groups out unchanged, and the trainer reads them as single-turn."""
    old = [json.dumps({"group_id": f"old{i:05d}aa", "worker_id": "w1", "policy_version": 0, "prompt_ids": [1, 2, 3],
                       "completions": [{"token_ids": [5, 6], "logprobs": [-0.5, -1.0], "reward": float(k % 2),
                                        "finish_reason": "stop"} for k in range(4)], "meta": {"task": "t"}},
                      separators=(",", ":")).encode() for i in range(3)]
    header = {"t": "commit", "protocol": common.PROTOCOL, "incarnation": 0, "seq": 0, "writer": "w", "time": time.time()}
    bucket.put(journal.object_name(0, 0), journal.encode(header, [*old, {"t": "counters", "counters": {}}]))
    p = start_proxy("--group-size", "4")
    assert p.stats()["buffer_size"] == 3 and p.stats()["incarnation"] == 1
    got = p.http.post("/v1/batches/lease", json={"num_groups": 3}).json()["groups"]
    assert [json.dumps({k: v for k, v in g.items()}, separators=(",", ":")).encode() for g in got] == old
    assert all(common.sampled_mask(c) == [1, 1] for g in got for c in g["completions"])


# ---- the trainer --------------------------------------------------------------------------------

def _model(tiny_model, **kw):
    args = train.Args(model=tiny_model, proxy_token="x", **kw)
    torch.manual_seed(0)
    model, _ = train.build_model(args)
    _perturb(model)
    return model, args


def _episode_group(model, T=1.0):
    """Four episodes of MASK's shape with rewards [1, 0, 0, 0], their sampled tokens' behaviour logprobs from
    the weights the trainer holds (on-policy), the tool's tokens without one."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(10, 2000, (6,), generator=g).tolist()
    comps = [torch.randint(10, 2000, (len(MASK),), generator=g).tolist() for _ in range(4)]
    lps = _behaviour(model, prompt, comps, T)
    return {"group_id": "episode-000", "worker_id": "w", "policy_version": 0, "prompt_ids": prompt,
            "completions": [{"token_ids": c, "logprobs": [x if m else None for x, m in zip(lp, MASK)], "mask": list(MASK),
                             "reward": r, "finish_reason": "stop"} for c, lp, r in zip(comps, lps, [1.0, 0.0, 0.0, 0.0])],
            "meta": {"temperature": T}}


def _reference_grads(model, group, positions, T=1.0):
    """The on-policy GRPO gradient by hand, a plain forward per episode: -(1/n) sum over `positions` of A
    d log pi (every objective's gradient when pi = mu)."""
    model.zero_grad(set_to_none=True)
    adv = common.group_advantages([[c["reward"] for c in group["completions"]]])[0]
    total, n = 0.0, len(positions) * len(group["completions"])
    P = len(group["prompt_ids"])
    for a, c in zip(adv, group["completions"]):
        logits = model(input_ids=torch.tensor([group["prompt_ids"] + c["token_ids"]])).logits[0, P - 1:-1].float() / T
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(c["token_ids"])[:, None]).squeeze(1)
        total = total - a * lp[positions].sum() / n
    total.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("objective", ["ppo", "cispo", "decoupled"])
@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_the_gradient_comes_only_from_the_sampled_tokens(tiny_model, objective, checkpointing):
    model, args = _model(tiny_model, loss=objective, gradient_checkpointing=checkpointing)
    group = _episode_group(model)
    model.zero_grad(set_to_none=True)
    st = train.train_step(model, [group], args, version=0, fresh_weights=True)
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    assert st["tokens"] == 4 * sum(MASK) and st["ratio/onpolicy_max_dev"] < 1e-4
    sampled = [i for i, m in enumerate(MASK) if m]
    assert torch.allclose(got, _reference_grads(model, group, sampled), atol=1e-6, rtol=1e-4)
    # the check can tell: a gradient that took the tool's tokens too is another one
    assert not torch.allclose(got, _reference_grads(model, group, list(range(len(MASK)))), atol=1e-6, rtol=1e-4)
