"""Episodes of several turns on the worker (lib/rollout/episodes.py, hf_engine.HFTurns, lib/shared/environments.py):
the token sequence is built turn by turn and never re-tokenised, the behaviour logprobs the hf engine records
across turns (its KV cache kept) are the trainer's to float precision, the environment's tokens are exactly
what the chat template writes for its messages, an environment whose history renders differently from the
tokens (drift) is caught and its group not sent, the budgets end episodes with the right finish_reason, and
the built-in calculator task runs end to end through a real proxy and trainer."""
import json
import os
import subprocess
import sys

import pytest
import torch

import environments
from conftest import ROOT, stop
from hf_engine import HFTurns
from episodes import Budget, Renderer, group_of, run_episodes, run_in_waves, waves
from environments import Environment, Session, Step
from models import completion_logprobs, load_base


@pytest.fixture(scope="module")
def tiny(tiny_model):
    model, tok = load_base(tiny_model)
    return model, tok


class Echo(Session):
    """Answers every model turn with 'echo: <its text>' for `turns` turns; can keep (and mangle) the history."""

    def __init__(self, prompt, turns=3, history=False, mangle=False):
        self.prompt, self.left, self.history, self.mangle, self.seen = prompt, turns, history, mangle, []

    def step(self, text):
        self.seen.append(text)
        self.left -= 1
        if self.left == 0:
            return Step([], done=True)
        msg = [{"role": "user", "content": f"echo: {text}"}]
        hist = None
        if self.history:
            # a history as an environment would keep it: the model's turns as text it decoded
            hist = list(self.prompt)
            for t in self.seen:
                hist += [{"role": "assistant", "content": t + " (edited)" if self.mangle else t},
                         {"role": "user", "content": f"echo: {t}"}]
        return Step(msg, done=False, history=hist)

    def score(self):
        return float(len(self.seen)), {"correct": 0.0}


def echo_env(turns=3, **kw) -> Environment:
    prompts = [[{"role": "user", "content": f"Say something about the number {i}."}] for i in range(4)]
    return Environment("echo", prompts, lambda i: Echo(prompts[i], turns, **kw), max_turns=8)


def run(tiny, env, G=3, budget=Budget(4, 6, 200), T=1.0, seed=0):
    model, tok = tiny
    torch.manual_seed(seed)
    eos = {tok.eos_token_id}
    rend = Renderer(tok, eos)
    idx = [0, 1]
    prompts = [rend.ids(env.prompts[i]) for i in idx]
    eps = run_episodes(HFTurns(model, eos, tok.pad_token_id, T), env, idx, prompts, G, budget, rend, 7)
    return eps, prompts, rend


def test_the_sampled_logprobs_across_turns_are_the_trainers(tiny, seed):
    model, tok = tiny
    eps, prompts, _ = run(tiny, echo_env(turns=3), seed=seed)
    comps = [e.completion(0.0) for e in eps]
    assert all(0 in c["mask"] for c in comps), "every episode had an environment turn"
    lp, _ = completion_logprobs(model, prompts, [c["token_ids"] for c in comps], 1.0, pad=0)
    for i, c in enumerate(comps):
        for j, (m, want) in enumerate(zip(c["mask"], c["logprobs"])):
            if m:
                assert abs(lp[i, j].item() - want) < 1e-4, (i, j, lp[i, j].item(), want)
            else:
                assert want is None


def test_a_new_version_between_turns_samples_the_next_turns_exactly(tiny_model, tmp_path, seed):
    """A swap between two turns (rollout.py --mid-round-swap, every engine): the first turn is version 1's,
    the later ones version 2's, each token recorded with its version, and its logprob what the trainer
    computes under that version (HFTurns recomputes its cache under the new weights: without that, the later
    turns would be sampled from version 2's weights on version 1's cache)."""
    import hf_engine
    from common import token_versions
    from runlib import hf_adapter
    v1, v2 = (hf_adapter(tiny_model, tmp_path / f"v{v}", v) for v in (1, 2))
    _, tok = load_base(tiny_model)
    scored = {v["version"]: hf_engine.swap_in(load_base(tiny_model)[0], v) for v in (v1, v2)}
    eos = {tok.eos_token_id}
    rend, env = Renderer(tok, eos), echo_env(turns=3)
    prompts = [rend.ids(env.prompts[i]) for i in (0, 1)]

    def episodes(turns_class) -> list[dict]:
        model = hf_engine.swap_in(load_base(tiny_model)[0], v1)
        swapped = []

        def swap():
            if swapped:
                return None
            hf_engine.swap_in(model, v2)
            swapped.append(2)
            return 2
        torch.manual_seed(seed)
        eps = run_episodes(turns_class(model, eos, tok.pad_token_id, 1.0), env, [0, 1], prompts, 3, Budget(4, 6, 200),
                           rend, 1, swap=swap)
        assert swapped and all(e.turns == 3 for e in eps)
        return [e.completion(0.0) for e in eps]

    def worst(comps) -> dict[int, float]:
        """The largest |recorded - recomputed| logprob over the sampled tokens of each version."""
        out = {1: 0.0, 2: 0.0}
        for v, m in scored.items():
            lp, _ = completion_logprobs(m, prompts, [c["token_ids"] for c in comps], 1.0, pad=0)
            for i, c in enumerate(comps):
                for j, (k, want, tv) in enumerate(zip(c["mask"], c["logprobs"], token_versions(c, 1))):
                    if k and tv == v:
                        out[v] = max(out[v], abs(lp[i, j].item() - want))
        return out
    comps = episodes(HFTurns)
    for c in comps:  # version 1 up to the second turn's first sampled token, version 2 from there on
        (_, a), (start, b) = c["versions"]
        assert (a, b) == (1, 2) and c["mask"][start] == 1 and c["mask"][start - 1] == 0
    got = worst(comps)
    assert got[1] < 1e-4 and got[2] < 1e-4, got

    class StaleCache(HFTurns):
        def rebuild(self):  # the new weights on the old version's cache
            pass
    assert worst(episodes(StaleCache))[2] > 1e-3


def test_the_environment_tokens_are_the_chat_templates_and_earlier_turns_stay_as_sampled(tiny, seed):
    model, tok = tiny
    eps, prompts, rend = run(tiny, echo_env(turns=2), G=2, seed=seed)
    for k, e in enumerate(eps):
        sampled = [t for t, m in zip(e.tokens, e.mask) if m]
        first_env = e.mask.index(0)
        first_turn = e.tokens[:first_env]
        env_ids = e.tokens[first_env:e.mask.index(1, first_env)]
        # the environment's tokens: the rest of the template's end of turn, the echo message, the assistant header
        closing = rend.closing[len(tok.decode([first_turn[-1]])):] if first_turn[-1] == tok.eos_token_id else rend.closing
        want = rend.text(rend.ref + [{"role": "user", "content": f"echo: {e.texts[0]}"}], True)[len(rend.base):]
        assert tok.decode(env_ids) == closing + want
        assert e.versions == [[0, 7]] and len(sampled) == sum(e.mask)
        assert e.turns == 2 and e.finish in ("stop", "length")


def test_drift_is_detected_counted_and_the_group_not_sent(tiny, seed):
    """An environment that re-renders the model's turns differently (it edits them) hands back a history whose
    tokens are not the episode's: every episode is caught at its first environment turn, ended, and its group
    is refused with the reason."""
    eps, _, _ = run(tiny, echo_env(turns=3, history=True, mangle=True), G=2, T=1.0, seed=seed)
    assert all(e.drift and "they part at token" in e.drift for e in eps), [e.drift for e in eps]
    assert all(e.finish == "stop" and e.turns == 1 for e in eps)
    comps, parts, why = group_of(eps[:2])
    assert why.startswith("episode 0: the environment's history renders to")


def test_a_history_kept_as_sampled_is_drift_only_where_the_text_re_tokenises_differently(tiny, seed):
    """An honest environment keeps the model's turns as the text it decoded; rendering that history gives the
    episode's tokens exactly when the text re-tokenises to the ids that were sampled (a random tiny model often
    samples ids that do not): the check must flag exactly those episodes and no others."""
    model, tok = tiny
    eps, _, _ = run(tiny, echo_env(turns=2, history=True), G=4, seed=seed)
    for e in eps:
        first = e.tokens[:e.mask.index(0)]
        sampled = first[:-1] if first[-1] == tok.eos_token_id else first
        as_sampled = tok.encode(e.texts[0], add_special_tokens=False) == sampled
        assert (e.drift is None) == as_sampled, (e.drift, e.texts[0])


def test_budgets_end_episodes_with_the_right_finish_reason(tiny, seed):
    eps, _, _ = run(tiny, echo_env(turns=50), G=2, budget=Budget(max_turns=2, max_new_tokens=4, max_tokens=500), seed=seed)
    assert all(e.turns == 2 and e.finish == "turns" for e in eps)
    eps, _, _ = run(tiny, echo_env(turns=50), G=2, budget=Budget(max_turns=50, max_new_tokens=4, max_tokens=60), seed=seed)
    assert all(e.finish == "length" and len(e.tokens) < 60 for e in eps)


class Counted(Echo):
    """Echo that counts the sessions open at once (a server's limit), and fails its step or its opening on cue."""
    open_now = most = 0

    def __init__(self, prompt, fail_step=False, fail_open=False):
        if fail_open:
            raise ConnectionError("the server refused the session")
        super().__init__(prompt, turns=2)
        self.fail_step = fail_step
        Counted.open_now += 1
        Counted.most = max(Counted.most, Counted.open_now)

    def step(self, text):
        if self.fail_step:
            raise RuntimeError("Server error: the game broke (code: EXECUTION_ERROR)")
        return super().step(text)

    def close(self):
        Counted.open_now -= 1


def test_waves_cover_a_round_group_major_within_the_session_limit():
    assert waves(2, 4, None) == waves(2, 4, 8) == [(0, 2, 4)]
    assert waves(3, 4, 8) == [(0, 2, 4), (2, 1, 4)]
    assert waves(2, 4, 3) == [(0, 1, 3), (0, 1, 1), (1, 1, 3), (1, 1, 1)]
    for n, G, limit in [(2, 4, 1), (3, 4, 5), (2, 8, 3)]:
        plan = waves(n, G, limit)
        assert all(k * g <= limit for _, k, g in plan)
        assert [j for first, k, g in plan for j in range(first, first + k) for _ in range(g)] == [
            j for j in range(n) for _ in range(G)]


def test_an_environment_of_one_session_runs_its_episodes_in_waves_and_a_failing_one_drops_only_its_group(tiny, seed):
    """An environment that allows one session at once (openenv-core's server at its defaults) gets every episode of
    the round, one session open at a time; a step or an opening that raises fails its episode, and its group says
    why, where it used to end the worker."""
    model, tok = tiny
    prompts = [[{"role": "user", "content": f"Say something about the number {i}."}] for i in range(3)]
    env = Environment("one-session", prompts, lambda i: Counted(prompts[i], fail_step=i == 1, fail_open=i == 2),
                      max_turns=8, max_sessions=1)
    rend = Renderer(tok, {tok.eos_token_id})
    ids = [rend.ids(p) for p in prompts]
    torch.manual_seed(seed)
    Counted.open_now = Counted.most = 0
    eps = run_in_waves(HFTurns(model, {tok.eos_token_id}, tok.pad_token_id, 1.0), env, [0, 1, 2], ids, 2,
                       Budget(4, 6, 200), rend, 7)
    assert [e.prompt_index for e in eps] == [0, 0, 1, 1, 2, 2] and Counted.most == 1 and Counted.open_now == 0
    assert group_of(eps[:2])[2] is None and all(e.turns == 2 for e in eps[:2])
    assert group_of(eps[2:4])[2] == ("episode 0: the environment's step failed: RuntimeError: Server error: the game "
                                     "broke (code: EXECUTION_ERROR)")
    assert group_of(eps[4:])[2] == ("episode 0: its session could not be opened: ConnectionError: the server refused "
                                    "the session")


def worker(data, proxy, run_name, tmp_path, *args) -> tuple[int, str, float]:
    """rollout.py on the jsonl task `data` (the default model), run to its end: exit status, stderr, peak RSS in MB
    (the process's own high-water mark, from wait4)."""
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / f"{data.stem}.log", "w+") as err:
        p = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--task", f"jsonl:{data}", "--group-size", "2",
                              "--prompts-per-round", "1", "--worker-id", "w1", "--no-serve", *args],
                             env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            _, status, usage = os.wait4(p.pid, 0)
        except BaseException:  # the test's timeout: no worker left behind
            p.kill()
            p.wait()
            raise
        p.returncode = os.waitstatus_to_exitcode(status)   # reaped: Popen must not wait for it again
        err.seek(0)
        return p.returncode, err.read(), usage.ru_maxrss / 1024


@pytest.mark.timeout(400)
def test_a_prompt_too_long_is_not_generated_and_a_worker_that_sends_nothing_stops(start_proxy, run_name, tmp_path):
    """Prompts of 1 MB (~200k tokens): each is refused before generation, its group dropped with the reason; after
    --max-failed-rounds (3) rounds in a row sent nothing, the worker stops, exit status 1, saying the first reason.
    Its memory meanwhile stays the model's: its peak RSS is within 100 MB of the same worker's on prompts of a few
    words, which it generates from (one round, then --max-rounds stops it). Measured (docs/results/environments.md):
    ~600 MB against ~970 MB; a forward pass over 200k tokens would want gigabytes."""
    small, huge = tmp_path / "small.jsonl", tmp_path / "huge.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(3)))
    huge.write_text("".join(json.dumps({"prompt": "many words " * 100_000, "answer": "1"}) + "\n" for _ in range(3)))
    proxy = start_proxy("--group-size", "2", "--no-pace")
    rc, said, normal_mb = worker(small, proxy, run_name, tmp_path, "--max-rounds", "1")
    assert rc == 0 and "round 1 v0" in said, said[-3000:]
    rc, said, huge_mb = worker(huge, proxy, run_name, tmp_path)
    assert rc == 1, said[-3000:]
    assert "group of prompt 0 not sent: its prompt has " in said, said[-3000:]
    assert ("tokens, more than 4096 (--max-prompt-tokens, the proxy's limit)" in said), said[-3000:]
    assert "stopping: 3 rounds in a row sent nothing (--max-failed-rounds); the first failure: group of prompt" in \
        said.splitlines()[-1], said[-3000:]
    print(f"peak RSS: {huge_mb:.0f} MB on 1 MB prompts, {normal_mb:.0f} MB on short ones")
    assert huge_mb < normal_mb + 100, (huge_mb, normal_mb)


# ---- the built-in calculator task ------------------------------------------------------------------

def test_the_calculator_evaluates_only_arithmetic():
    assert environments.calc("347 * 28") == "= 9716"
    assert environments.calc("(2 + 3) x 4") == "= 20"
    assert environments.calc("1 / 0").startswith("error")
    assert environments.calc("__import__('os')").startswith("error")
    assert environments.calc("9" * 20 + " * " + "9" * 20) == "error: too large"


def test_a_calculator_episode_scores_the_final_answer_and_counts_the_call():
    env = environments.calculator()
    a, b = [int(x) for x in env.prompts[0][-1]["content"].rstrip("?").split()[2::2]]
    s = env.session(0)
    step = s.step(f" {a} * {b}")
    assert not step.done and step.messages == [{"role": "user", "content": f"= {a * b}"}]
    assert s.step(f"{a * b}").done
    assert s.score() == (1.0, {"correct": 1.0, "diag_tool_call": 1.0})
    s = env.session(0)
    assert s.step("It is 12.").done and s.score() == (0.0, {"correct": 0.0, "diag_tool_call": 0.0})


@pytest.mark.timeout(900)
def test_the_calculator_runs_end_to_end_through_proxy_and_trainer(start_proxy, bucket, run_name, tiny_model, tmp_path):
    proxy = start_proxy("--group-size", "4", "--max-completion-tokens", "96")
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "rollout.log", "w")
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--model", tiny_model, "--task", "calculator",
                               "--group-size", "4", "--prompts-per-round", "2", "--max-new-tokens", "6",
                               "--max-episode-tokens", "96", "--worker-id", "w1", "--no-serve"],
                              env=env, stdout=log, stderr=log)
    try:
        train = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", tiny_model, "--max-steps", "2",
                                "--batch-groups", "2", "--lease-wait-s", "5", "--no-skip-zero-std"],
                               env=env, capture_output=True, text=True, timeout=600)
        assert train.returncode == 0, train.stderr[-3000:]
        worker.wait(timeout=120)
    finally:
        stop(worker)
    assert worker.returncode == 0, (tmp_path / "rollout.log").read_text()[-3000:]
    rows = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/diag_tool_call" in r for r in rows)
    roll = [json.loads(x) for x in bucket.get("metrics/rollout-w1.jsonl")[0].decode().splitlines()]
    assert all("rollout/turns_mean" in r and r["rollout/drift_episodes"] == 0 for r in roll if "rollout/gen_s" in r)


# ---- the loopback generate endpoint (what verifiers' train client calls) ----------------------------

def test_the_loopback_endpoint_serves_the_engine_records_calls_and_rebuilds_episodes_with_the_drift_check(tiny, seed,
                                                                                                           caplog):
    """POST /inference/v1/generate on loopback: the worker's key only; what it answers is what the engine sampled
    (recorded by X-Session-ID, with the temperature); an episode is rebuilt from the calls: each later prompt's
    extension is the environment's (mask 0), and a later prompt that re-renders an earlier turn differently is drift.
    Sampling the engine does not do (top_p, a temperature the trainer cannot score at) is refused with a 400 that says
    why, nothing recorded; a seed is served but the log says once that it is not honoured; what no episode took is
    dropped at the round's end (Calls.drop_all), not kept for ever."""
    import threading
    import httpx
    from hf_engine import hf_generate
    from generate_server import GenerateServer, episode_of
    model, tok = tiny
    torch.manual_seed(seed)
    srv = GenerateServer(lambda seqs, m, t, stop: hf_generate(model, {tok.eos_token_id} | stop, tok.pad_token_id,
                                                               seqs, m, t), "policy", 512, version=lambda: 3)
    url = srv.start()
    done = threading.Event()
    threading.Thread(target=srv.serve_batches, args=(done.is_set,), daemon=True).start()
    try:
        assert httpx.post(f"{url}/inference/v1/generate", json={"token_ids": [1, 2]}).status_code == 401
        auth = {"authorization": f"Bearer {srv.key}", "x-session-id": "ep1"}
        prompt = Renderer(tok, {tok.eos_token_id}).ids([{"role": "user", "content": "Hi"}])

        def call(ids):
            r = httpx.post(f"{url}/inference/v1/generate", headers=auth, timeout=60,
                           json={"token_ids": ids, "sampling_params": {"max_tokens": 5, "temperature": 1.0}})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        first = call(prompt)
        env = tok.encode("<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        second = call(prompt + first + env)
        calls = srv.calls.take("ep1")
        assert [c.ids for c in calls] == [first, second] and all(c.version == 3 for c in calls)
        tokens, mask, lps, versions, drift = episode_of(calls, prompt)
        assert drift is None and tokens == first + env + second and versions == [[0, 3]]
        assert mask == [1] * len(first) + [0] * len(env) + [1] * len(second)
        assert [lp is None for lp in lps] == [m == 0 for m in mask]
        # the library re-renders the first turn (here: one token changed) in the second call's prompt
        bent = prompt + [first[0] + 1] + first[1:] + env
        call(bent)
        tokens, mask, _, _, drift = episode_of([calls[0], srv.calls.take("ep1")[0]], prompt)
        assert drift and "does not extend" in drift and tokens == first
        assert [c.temperature for c in calls] == [1.0, 1.0]
        for sp, said in [({"temperature": 1.0, "top_p": 0.9}, "cannot sample as asked: top_p=0.9: the worker samples "
                          "from the model's whole distribution at the temperature only (the behaviour logprob must be "
                          "of the distribution sampled from); leave it unset"),
                         ({"temperature": 0}, "cannot sample as asked: temperature 0 is not a number in [0.05, 10.0]")]:
            r = httpx.post(f"{url}/inference/v1/generate", headers=auth, timeout=60,
                           json={"token_ids": prompt, "sampling_params": {"max_tokens": 5, **sp}})
            assert r.status_code == 400 and r.json()["detail"].startswith(said), r.text
        assert srv.calls.by_session == {}
        for s in (7, 8):  # served, recorded; said once, whatever the seed
            r = httpx.post(f"{url}/inference/v1/generate", headers=auth, timeout=60,
                           json={"token_ids": prompt, "sampling_params": {"max_tokens": 2, "seed": s}})
            assert r.status_code == 200, r.text
        said = [r.getMessage() for r in caplog.records if "not honoured" in r.getMessage()]
        assert said == ["loopback generate: seed=7 is not honoured: the worker samples each batch of calls from one "
                        "random stream, so a call's seed does not make its sample reproducible (the distribution and "
                        "the behaviour logprobs are unchanged)"], said
        assert len(srv.calls.take("ep1")) == 2
        # calls of sessions no episode takes (another agent's trace, a stray one) go at the round's end
        call(prompt)
        httpx.post(f"{url}/inference/v1/generate", timeout=60, headers={"authorization": f"Bearer {srv.key}"},
                   json={"token_ids": prompt, "sampling_params": {"max_tokens": 2}})  # no X-Session-ID
        assert srv.calls.drop_all() == (2, 2) and srv.calls.by_session == {}
    finally:
        done.set()
        srv.stop()
