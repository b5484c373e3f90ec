"""evaluate.py as a real process against the local S3 server, on the tiny random model: the base
model (version 0) and published adapters on addition and on a local JSONL; results land next to
each version; corrupt or unpublished versions give a clear error and write nothing."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

import common
import tasks


def run_eval(env, *flags, ok=True):
    p = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), *flags], env=env, capture_output=True,
                       text=True, timeout=600)
    assert (p.returncode == 0) == ok, p.stderr[-3000:]
    return p


def publish_random_adapter(bucket, tiny_model, tmp_path, version):
    """A LoRA adapter whose B matrices are random (not the usual zeros), so it changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(version)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=64, target_modules="all-linear", init_lora_weights=False))
    d = tmp_path / f"adapter-v{version}"
    peft.save_pretrained(d)
    common.publish_adapter(bucket, d, version, step=version, base_model=tiny_model)


def last_line(completion: str) -> str:
    """What a jsonl task's text answer is compared with: the text after the last '####', else the last line."""
    return completion.rsplit("####", 1)[-1] if "####" in completion else (completion.strip().splitlines() or [""])[-1]


def norm(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .")


@pytest.mark.timeout(900)  # four evaluate.py processes: 1.5 min on a quiet machine, over 5 at load 9
def test_evaluate_addition_and_jsonl(tiny_model, bucket, run_name, tmp_path):
    env = {**os.environ, "RUN_NAME": run_name, "OMP_NUM_THREADS": "1"}
    base = ["--model", tiny_model, "--max-new-tokens", "4", "--batch-size", "8"]

    # version 0 = the base model on addition's 20 held-out sums
    p = run_eval(env, *base, "--version", "0")
    res = bucket.get_json("adapters/v000000/eval_addition.json")
    assert res["version"] == 0 and res["task"] == "addition" and res["n"] == 20
    assert set(res["components"]) == {"correct", "diag_just_number"} and 0.0 <= res["accuracy"] <= 1.0
    assert json.loads(p.stdout.strip().splitlines()[-1])["accuracy"] == res["accuracy"]
    (cfg,) = [bucket.get_json(k) for k in bucket.list("config/evaluate-")]   # recorded at start
    assert cfg["args"]["version"] == 0 and cfg["command"].startswith("python evaluate.py --version 0 --model ")
    held_out = tasks.load_task("addition", "eval")
    assert len(res["examples"]) == 3
    for ex in res["examples"]:   # the stored examples are held-out prompts, scored by the task's own reward
        i = held_out.prompts.index(ex["prompt"])
        assert ex["answer"] == held_out.answers[i]

    # two published versions, a local JSONL, --all: every version gets a result next to it
    publish_random_adapter(bucket, tiny_model, tmp_path, 1)
    publish_random_adapter(bucket, tiny_model, tmp_path, 2)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(20)))
    p = run_eval(env, *base, "--task", f"jsonl:{data}", "--all")
    results = [bucket.get_json(f"adapters/v{v:06d}/eval_jsonl-sums.json") for v in (0, 1, 2)]
    assert [r["version"] for r in results] == [0, 1, 2]
    assert all(r["n"] == 2 and r["task"] == "jsonl-sums" for r in results)           # the last tenth of 20 rows
    assert [ex["prompt"] for ex in results[0]["examples"]] == ["What is 18 + 18?", "What is 19 + 19?"]
    assert set(results[1]["components"]) == {"correct", "format"}
    # the adapters were really applied: greedy outputs differ from the base model's
    assert [ex["completion"] for ex in results[1]["examples"]] != [ex["completion"] for ex in results[0]["examples"]]
    assert "accuracy per version (jsonl-sums): v0:" in p.stderr and "v2:" in p.stderr

    # the accuracy against a value known by construction: the same 20 prompts, the two held out answered
    # with v1's own greedy completion of the first (its last line, as a jsonl text answer is compared) and
    # with a text no completion is: v1 must score exactly 1/2. Every version scores what the last-line
    # rule, applied here to its completions (all n of them are in "examples"), says
    own = last_line(results[1]["examples"][0]["completion"])
    assert norm(own) and not tasks._NUM.fullmatch(own) and not tasks._MATHY.search(own), own  # a text answer
    answers = [own, "no completion says this"]
    known = tmp_path / "known.jsonl"
    known.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": answers[i - 18] if i >= 18 else "x"})
                             + "\n" for i in range(20)))
    run_eval(env, *base, "--task", f"jsonl:{known}", "--all")
    scored = [bucket.get_json(f"adapters/v{v:06d}/eval_jsonl-known.json") for v in (0, 1, 2)]
    for r, before in zip(scored, results):
        completions = [ex["completion"] for ex in r["examples"]]
        assert r["n"] == len(completions) == 2 and completions == [ex["completion"] for ex in before["examples"]]
        assert r["accuracy"] == sum(norm(last_line(c)) == norm(a) for c, a in zip(completions, answers)) / 2, r
    assert scored[1]["accuracy"] == 0.5, scored[1]

    # --all again: nothing left to do, nothing rewritten
    before = [r["created_at"] for r in results]
    run_eval(env, *base, "--task", f"jsonl:{data}", "--all")
    assert [bucket.get_json(f"adapters/v{v:06d}/eval_jsonl-sums.json")["created_at"] for v in (0, 1, 2)] == before


def test_evaluate_refuses_corrupt_and_unpublished_versions(tiny_model, bucket, run_name, tmp_path):
    env = {**os.environ, "RUN_NAME": run_name, "OMP_NUM_THREADS": "1"}
    base = ["--model", tiny_model, "--max-new-tokens", "2", "--limit", "2"]
    publish_random_adapter(bucket, tiny_model, tmp_path, 1)
    data, _ = bucket.get("adapters/v000001/adapter_model.safetensors")
    bucket.put("adapters/v000001/adapter_model.safetensors", data[:-8] + b"\0" * 8)   # same size, wrong bytes
    p = run_eval(env, *base, "--version", "1", ok=False)
    assert "not evaluating version 1" in p.stderr and "sha256" in p.stderr
    assert bucket.get("adapters/v000001/eval_addition.json") is None
    p = run_eval(env, *base, "--version", "7", ok=False)
    assert "version 7 is not published" in p.stderr and "published: [1]" in p.stderr
    other = str(tmp_path / "another-model")
    p = run_eval(env, *base, "--model", other, "--version", "1", ok=False)  # the last --model wins
    assert f"not evaluating version 1: trained on {tiny_model!r}, not {other!r}" in p.stderr


def test_evaluate_runs_an_environment_through_the_workers_episode_runner(tiny_model, bucket, run_name):
    """--task calculator: greedy episodes of several turns on the held-out split, scored by the environment; the
    result is the episode runner's own (the same greedy episodes run in-process give the same texts and scores)."""
    env = {**os.environ, "RUN_NAME": run_name, "OMP_NUM_THREADS": "1"}
    run_eval(env, "--model", tiny_model, "--max-new-tokens", "6", "--batch-size", "4", "--limit", "4",
             "--task", "calculator", "--version", "0")
    res = bucket.get_json("adapters/v000000/eval_calculator.json")
    assert res["task"] == "calculator" and res["n"] == 4
    assert {"correct", "diag_tool_call", "turns", "drift"} <= set(res["components"])
    import environments
    from hf_engine import HFTurns
    from episodes import Budget, Renderer, run_episodes
    from models import load_base
    model, tok = load_base(tiny_model)
    calc = environments.load_environment("calculator", "eval")
    rend = Renderer(tok, {tok.eos_token_id})
    eps = run_episodes(HFTurns(model, {tok.eos_token_id}, tok.pad_token_id, 0.0), calc, [0, 1, 2], [rend.ids(calc.prompts[i])
                       for i in range(3)], 1, Budget(calc.max_turns, 6, 512), rend, 0)
    assert [x["completion"] for x in res["examples"]] == [" | ".join(e.texts) for e in eps]
    assert res["examples"][0]["prompt"] == calc.prompts[0]


def test_a_reward_of_another_scale_is_no_accuracy():
    """An environment whose rewards are 42: no 'accuracy 39.1', the mean reward is the result; a reasoning-gym
    partial credit (0.4) is in [0, 1] and counts."""
    import evaluate
    assert evaluate.accuracy([{"correct": 42.0}, {"correct": 36.2}]) is None
    assert evaluate.accuracy([{"correct": 1.0}, {"correct": 0.4}]) == 0.7
    curve = [(0, {"accuracy": None, "reward_mean": 39.1}), (3, {"accuracy": None, "reward_mean": 41.0})]
    assert evaluate.curve_line("openenv-x", curve) == "result per version (openenv-x): v0: mean reward 39.100  v3: mean reward 41.000"
    assert evaluate.curve_line("addition", [(0, {"accuracy": 0.25, "reward_mean": 0.25})]) == "accuracy per version (addition): v0: 0.250"


@pytest.mark.timeout(900)
def test_a_finished_local_run_is_evaluated_from_its_folder_and_the_base_model_needs_no_bucket(tiny_model, bucket,
                                                                                               run_name, tmp_path):
    """A local run's bucket stops with it: report.py copies its last adapter into the run's folder, evaluate.py
    --run-dir reads it there (sha256-checked) and writes its result there; --version 0 runs with no bucket at all,
    and any other version without one says where adapters are read from."""
    import report
    for v in (1, 2):
        publish_random_adapter(bucket, tiny_model, tmp_path, v)
    run = tmp_path / "runs" / "my-run"
    assert report.save_adapters(bucket, str(run), "last") == [2]
    assert (run / "adapters" / "v000002" / "meta.json").is_file() and not (run / "adapters" / "v000001").exists()
    env = {k: v for k, v in os.environ.items() if k != "BUCKET"} | {"OMP_NUM_THREADS": "1"}
    base = ["--model", tiny_model, "--max-new-tokens", "2", "--limit", "2"]
    p = run_eval(env, *base, "--run-dir", str(run))  # the latest version there: 2
    res = json.loads((run / "adapters" / "v000002" / "eval_addition.json").read_text())
    assert res["version"] == 2 and json.loads(p.stdout.strip().splitlines()[-1])["accuracy"] == res["accuracy"]
    assert "accuracy per version (addition): v2: " in p.stderr
    p = run_eval(env, *base, "--run-dir", str(run), "--version", "1", ok=False)
    assert (f"version 1 is not published in {run}/adapters/ (a local run saves its last version there; "
            "`bash launch_jobs.sh --local --keep-adapters all` saves every one) (published: [2])") in p.stderr
    p = run_eval(env, *base, "--version", "0")
    assert json.loads(p.stdout.strip().splitlines()[-1])["version"] == 0
    assert "(no BUCKET and no --run-dir: the result is printed, not stored)" in p.stderr
    p = run_eval(env, *base, "--version", "2", ok=False)
    assert ("evaluate.py reads a run's adapters from its bucket (set BUCKET, RUN_NAME and S3_ENDPOINT_URL) or, for a "
            "finished local run, from its folder: --run-dir runs/NAME") in p.stderr
    p = run_eval(env, *base, "--run-dir", str(tmp_path / "nope"), ok=False)
    assert f"--run-dir {tmp_path / 'nope'}: no such folder" in p.stderr
