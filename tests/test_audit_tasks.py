"""The trainer's audit of participants' groups on an environment task (issue #44, part E; lib/train/audit_tasks.py):
a calculator episode is replayed (each model turn given to a fresh session, whose answers must be the environment
tokens the episode has, and whose score must be the reward), so an honest participant's group passes and is trained
on, a lying reward or a forged tool result is caught and counted against its sender; a library environment's groups
(openenv, verifiers) are audited without a prompt or reward check and without stopping the trainer. The episodes are
made by the real runner and environment; only the policy's turns are written by the test (the texts a participant
chose: what the audit cannot tell from sampled ones, docs/trust.md)."""
import math
import re

import pytest
import torch

import train
from common import sampled_mask
from environments import CalculatorSession, Environment, Step, calc, load_environment
from episodes import Budget, Renderer, group_of, run_episodes
from models import completion_logprobs
from proxyproc import spawn  # noqa: F401 - a fixture
from test_hostile_groups import honest, trainer
from test_proxy_access import as_, create, leased, open_dataset

G = 4


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.manual_seed(0)
    return train.build_model(train.Args(model=tiny_model))


class Scripted:
    """The policy's turns as the test writes them (episodes.run_episodes' turn sampler): episode k's texts in order,
    each ended by the EOS a model ends its turn with."""

    def __init__(self, tok, scripts: list[list[str]]):
        self.tok, self.scripts, self.said = tok, scripts, {}

    def start(self, prompts, G):
        pass

    def turn(self, feed: dict, room: dict) -> dict:
        out = {}
        for k in feed:
            n = self.said[k] = self.said.get(k, -1) + 1
            ids = self.tok.encode(self.scripts[k][n], add_special_tokens=False) + [self.tok.eos_token_id]
            out[k] = (ids[:room[k]], [0.0] * len(ids[:room[k]]), "stop")
        return out

    def rebuild(self):
        pass


class ForgedResult(CalculatorSession):
    """A participant's own calculator, whose results are off by one (and which scores the answer its results lead to)."""

    def step(self, text: str) -> Step:
        step = super().step(text)
        if step.messages:
            value = int(calc(text.strip()).removeprefix("= "))
            step.messages[0]["content"] = f"= {value + 1}"
        return step


def calculator_group(model, alice, forged: bool = False) -> dict:
    """A participant's group on the calculator task, as rollout.py makes one: a prompt alice leased, four episodes
    run by the real runner (two call the calculator), each completion scored by its session, the behaviour logprobs
    those of the model the trainer holds (version 0)."""
    m, tok = model
    env = load_environment("calculator")
    lease = leased(alice, dataset=env.name, size=len(env.prompts))[0]
    i = lease["prompt_index"]
    answer = env.session(i).answer
    a, b = env.prompts[i][-1]["content"].removeprefix("What is ").removesuffix("?").split(" * ")
    if forged:
        env = Environment(env.name, env.prompts, lambda i: ForgedResult(answer + 1), env.max_turns)
    scripts = [[f"{a} * {b}", str(answer + forged)], ["12"], [f"{a} * {b}", "7"], [str(answer + forged)]]
    renderer = Renderer(tok, {tok.eos_token_id})
    prompt = renderer.ids(env.prompts[i])
    eps = run_episodes(Scripted(tok, scripts), env, [i], [prompt], G, Budget(3, 24, 256), renderer, 0)
    comps, parts, drift = group_of(eps)
    assert drift is None and [e.tool_turns for e in eps] == [1, 0, 1, 0] and [c["reward"] for c in comps] == [1, 0, 0, 1]
    with torch.no_grad():
        logp, _ = completion_logprobs(m, [prompt], [c["token_ids"] for c in comps], 1.0, pad=0)
    for c, row in zip(comps, logp.tolist()):
        c["logprobs"] = [lp if x else None for lp, x in zip(row, sampled_mask(c))]
    return {"group_id": f"calc{forged:d}{i:06d}", "worker_id": "alice-1", "policy_version": 0, "prompt_ids": prompt,
            "completions": comps, **lease, "meta": {"task": env.name, "temperature": 1.0,
                                                    "reward_components": {"correct": 0.5}}}


def audited_batch(p, t, groups: list[dict]) -> dict:
    """The groups, leased by the trainer from the real proxy, through the trainer's own audit (train.Trainer.audit)."""
    got = p.http.post("/v1/batches/lease", json={"num_groups": len(groups)}).json()
    assert len(got["groups"]) == len(groups)
    got["fresh"] = got["groups"]
    got["fresh"], got["audit"] = t.audit(got)
    return got


def env_trainer(tiny_model, p, model, task: str):
    """train.Trainer on the run's --task `task`, its audit on (every group's reward re-scored), at version 0."""
    from audit import Auditor, Options
    t = trainer(tiny_model, p, model, "cispo")
    t.version, t.since_publish = 0, 0
    t.auditor = Auditor(Options(), task, model[1], None, t.client, 2, lambda g: 1.0, lambda g: True)
    return t


@pytest.mark.parametrize("lie", ["none", "reward", "tool result"])
def test_a_calculator_episode_is_replayed_by_the_audit(tiny_model, model, spawn, lie):
    p = spawn("--max-staleness", "4")
    alice = as_(p, create(p, "alice"))
    open_dataset(p, "calculator", 2000)
    t = env_trainer(tiny_model, p, model, "calculator")
    g = calculator_group(model, alice, forged=lie == "tool result")
    if lie == "reward":
        g["completions"][1]["reward"] = 1.0  # "12" is not the product
    assert alice.post("/v1/groups", json=g).json()["status"] == "accepted"
    got = audited_batch(p, t, [g])
    checks = p.stats()["participants"]["alice"]["checks"]
    if lie == "none":  # passed, and the step trains on it (its on-policy logprobs checked in its own forward)
        assert len(got["fresh"]) == 1 and got["audit"]["audit/failed"] == 0 and got["audit"]["audit/groups"] == 1
        st, norm = train.learn(t, got)
        assert st["groups/trained"] == 1 and math.isfinite(norm) and "audit/redone" not in got["audit"]
        assert checks["failed"] == 0 and checks["checked"] == 1
        return
    assert got["fresh"] == [] and got["audit"]["audit/failed_reward"] == 1
    why = checks["recent"][0]["detail"]
    assert checks["by_check"] == {"reward": 1}, checks
    if lie == "reward":
        assert why == "completion 1 claims reward 1; the task's reward of it is 0", why
    else:
        assert why.startswith("completion 0: the environment tokens after model turn 1 are not the environment's answer"), why
        forged, real = map(int, re.findall(r"= (\d+)", why))
        assert forged == real + 1, why


def test_a_library_environments_group_is_audited_without_a_prompt_or_reward_check(tiny_model, model, spawn):
    """openenv and verifiers episodes are not replayed: the trainer does not stop, says what it does not check, leaves
    the honest group in, and still recomputes its logprobs (a made-up one fails)."""
    p = spawn()
    alice = as_(p, create(p, "alice"))
    t = env_trainer(tiny_model, p, model, "openenv:http://127.0.0.1:9")
    said = []
    t.auditor.say = said.append
    good, bad = honest(model, 5, alice), honest(model, 6, alice)
    bad["completions"][0]["logprobs"] = [x - 0.7 for x in bad["completions"][0]["logprobs"]]
    t.auditor.opts.logprob_share = 1.0
    t.since_publish = 1  # a step since version 0: its groups' logprobs are recomputed by the audit, under version 0's
    t.auditor.weights.remember(0, model[0])  # weights (those the module's model holds: the groups' were computed so)
    for g in (good, bad):
        assert alice.post("/v1/groups", json=g).json()["status"] == "accepted"
    got = audited_batch(p, t, [good, bad])
    assert [g["group_id"] for g in got["fresh"]] == [good["group_id"]]
    assert got["audit"]["audit/failed_logprobs"] == 1 and got["audit"]["audit/failed_prompt"] == 0
    assert any("episodes are not replayed here" in s and "behaviour logprobs are" in s for s in said), said
