# /// script
# requires-python = ">=3.10"
# dependencies = [
#   "torch>=2.4", "transformers>=5.0", "peft>=0.17", "safetensors>=0.4", "boto3>=1.36",
#   "httpx>=0.27", "tenacity>=8.2", "pydantic>=2.7", "tyro>=0.9", "gguf>=0.10", "datasets>=3.0",
#   "math-verify[antlr4_13_2]>=0.9",
# ]
# ///
"""Greedy accuracy of published adapter versions on a task's held-out split, written to the bucket
next to each version (adapters/v{N:06d}/eval_<task>.json), so a run has an accuracy-per-version curve.

    python evaluate.py --version 0                        # the base model (version 0) on addition's held-out sums
    python evaluate.py --run-dir runs/local-20260101-120000 # a finished local run: its last adapter, saved there
    python evaluate.py --version 12 --task jsonl:my.jsonl # env: BUCKET, RUN_NAME, S3_ENDPOINT_URL, AWS_*
    python evaluate.py --all                              # every version without a result yet, then the curve
    hf jobs uv run --flavor l4x1 --timeout 2h --secrets HF_TOKEN --secrets AWS_ACCESS_KEY_ID \
        --secrets AWS_SECRET_ACCESS_KEY -e BUCKET=async-grpo -e RUN_NAME=my-run \
        -e S3_ENDPOINT_URL=https://s3.hf.co/$HF_NAMESPACE \
        -- evaluate.py common.py lib/rollout/engines.py lib/rollout/hf_engine.py lib/rollout/episodes.py \
        lib/shared/chat_render.py lib/shared/env_types.py lib/shared/environments.py lib/shared/models.py \
        lib/shared/openenv_env.py lib/shared/owned_process.py lib/shared/proxy_client.py lib/shared/run_folder.py \
        lib/shared/runconfig.py lib/shared/tasks.py \
        --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --all   # on HF Jobs
    python evaluate.py --live --task addition                 # the live policy, through the proxy (PROXY_URL, PROXY_TOKEN)

Held-out split (tasks.load_task(name, "eval")): GSM8K's test split, MATH-500 for math; for addition
and jsonl:PATH a fixed slice that training never sees. Every adapter is sha256-verified (common.fetch_adapter) and
must have been trained on --model. Greedy decoding, so a result is reproducible and "accuracy" is
the mean of the task's `correct` reward component, where each is in [0, 1] (else none: the mean reward is the
result). --version 0 needs no bucket (the result is printed only); a finished local run, whose bucket stopped with
it, is read from its folder (--run-dir: report.py saved its adapters there, run_folder.py).

--live loads no model: it sends each held-out prompt as a greedy chat request to the proxy
(POST /v1/chat/completions, routing.py), where the run's serving rollout workers answer with the
adapter they serve at that moment; the result counts which adapter versions answered. It needs only
the proxy's URL and token (no bucket keys), and is written to the bucket (evals/) when BUCKET is set.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Literal

import httpx
import torch

# common first: importing it puts the lib/ folders on sys.path (in a job every file lands beside this one)
from common import AdapterError, Bucket, adapter_prefix, fetch_adapter, script_args
from proxy_client import ProxyClient
from models import LOCAL_MODEL, encode_prompt, load_base, pad_left, peft_calls
from runconfig import record_config
from run_folder import RunFolder
from tasks import load_task, token_budget
from environments import is_environment, load_environment
from hf_engine import HFTurns
from episodes import Budget, Renderer, run_episodes


@dataclass
class Args:
    version: int = -1
    """adapter version to evaluate; 0 = the base model (needs no bucket), -1 = the latest published"""
    run_dir: str | None = None
    """a finished local run's folder (runs/NAME): its adapters as report.py saved them (the last version unless
    report.py --adapters all), read instead of a bucket; the results are written there"""
    all: bool = False
    """evaluate every published version (and 0) that has no result for this task yet"""
    model: str = LOCAL_MODEL
    """the base model the run trains (a Hub id, a local dir, or the local SmolLM2)"""
    task: str = "addition"
    """addition, gsm8k, math or jsonl:PATH (PATH may be s3://BUCKET/KEY); or an environment of several turns:
    calculator, reasoning-gym:NAME, openenv:URL (rollout.py's episode runner, greedy, one episode per prompt)"""
    max_turns: int = 0
    """environments: model turns per episode at most (0: the environment's own limit)"""
    max_episode_tokens: int = 512
    """environments: tokens per episode after the prompt at most (sampled and environment tokens)"""
    limit: int = 0
    """only the first N held-out prompts (0: all of them)"""
    batch_size: int = 32
    max_new_tokens: int | None = None
    """tokens per model turn (default: the task kind's, as rollout.py: tasks.token_budget)"""
    threads: int = 0
    """torch threads on CPU (0: torch's default)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """base model dtype (auto: bfloat16 on a GPU of compute capability >= 8.0, else float32)"""
    overwrite: bool = False
    """re-evaluate a version that already has a result"""
    live: bool = False
    """evaluate the policy the run's workers serve now, through the proxy's routed chat endpoint (no model here)"""
    proxy_url: str = field(default_factory=lambda: os.environ.get("PROXY_URL", "http://127.0.0.1:8000"))
    """--live: the proxy (env PROXY_URL)"""
    proxy_token: str | None = field(default_factory=lambda: os.environ.get("PROXY_TOKEN"))
    """--live: the proxy token (env PROXY_TOKEN)"""
    hf_token: str | None = field(default_factory=lambda: os.environ.get("PROXY_HF_TOKEN"))
    """--live: HF token for the Jobs --expose gateway in front of the proxy (env PROXY_HF_TOKEN)"""
    live_wait_s: float = 900.0
    """--live: how long one request may wait for its answer (the proxy gives up first: its --route.timeout-s, 300 s)"""


def accuracy(parts: list[dict]) -> float | None:
    """The share answered right: the mean `correct` component where each is in [0, 1] (right, wrong, or partly right
    as reasoning-gym scores); None for a reward of another scale (an environment's 42 is no accuracy)."""
    correct = [p["correct"] for p in parts]
    return sum(correct) / len(correct) if correct and all(0 <= c <= 1 for c in correct) else None


def curve_line(task_name: str, curve: list[tuple[int, dict]]) -> str:
    """The results per version in one line: accuracies, or mean rewards where a result has no accuracy."""
    said = lambda r: (f"{r['accuracy']:.3f}" if r.get("accuracy") is not None  # noqa: E731
                      else f"mean reward {r['reward_mean']:.3f}")
    what = "accuracy" if all(r.get("accuracy") is not None for _, r in curve) else "result"
    return f"{what} per version ({task_name}): " + "  ".join(f"v{v}: {said(r)}" for v, r in curve)


def result_key(version: int, task_name: str) -> str:
    return f"{adapter_prefix(version)}/eval_{re.sub(r'[^A-Za-z0-9_.-]', '-', task_name)}.json"


def published_versions(bucket: Bucket) -> list[int]:
    keys = bucket.list("adapters/")
    return sorted({int(m.group(1)) for k in keys if (m := re.match(r"adapters/v(\d{6})/meta\.json$", k))})


@torch.no_grad()
def greedy(model, tok, prompts: list[str], max_new: int, batch_size: int, device) -> list[str]:
    """Greedy completions, left-padded batches of the same chat-formatted ids the workers sample from."""
    out = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = pad_left([encode_prompt(tok, p) for p in prompts[i:i + batch_size]], tok.pad_token_id)
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        out += tok.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
        print(f"  {len(out)}/{len(prompts)}", file=sys.stderr, flush=True)
    return out


def greedy_episodes(model, tok, env, n: int, args: Args) -> tuple[list[str], list[dict]]:
    """One greedy episode per held-out prompt through the workers' episode runner (episodes.run_episodes, hf
    turns with the KV cache kept); (each episode's model turns joined, its reward components)."""
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    eos = {e for e in [tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])] if e is not None}
    renderer = Renderer(tok, eos)
    budget = Budget(args.max_turns or env.max_turns or 1, args.max_new_tokens, args.max_episode_tokens)
    texts, parts = [], []
    for i in range(0, n, args.batch_size):
        idx = list(range(i, min(n, i + args.batch_size)))
        eps = run_episodes(HFTurns(model, eos, tok.pad_token_id, 0.0), env, idx, [renderer.ids(env.prompts[k]) for k in idx],
                           1, budget, renderer, 0)
        texts += [" | ".join(e.texts) for e in eps]
        parts += [{**e.parts, "turns": float(e.turns), "drift": float(e.drift is not None)} for e in eps]
        print(f"  {len(texts)}/{n}", file=sys.stderr, flush=True)
    return texts, parts


def evaluate(args: Args, bucket: Bucket, base, tok, task, version: int, device) -> dict:
    model = base
    if version > 0:
        with tempfile.TemporaryDirectory() as d, peft_calls():  # without bitsandbytes
            from peft import PeftModel
            meta = fetch_adapter(bucket, version, d)  # raises AdapterError unless every sha256 matches
            if meta.get("base_model") not in (None, args.model):
                raise AdapterError(f"version {version} was trained on {meta['base_model']!r}, not {args.model!r}")
            model = PeftModel.from_pretrained(base, d, adapter_name=f"v{version}").to(device).eval()
    n = len(task.prompts) if args.limit <= 0 else min(args.limit, len(task.prompts))
    t0 = time.time()
    if is_environment(args.task):
        completions, parts = greedy_episodes(model, tok, task, n, args)
        rewards = [p["correct"] for p in parts]
    else:
        completions = greedy(model, tok, task.prompts[:n], args.max_new_tokens, args.batch_size, device)
        scored = [task.reward(c, i) for i, c in enumerate(completions)]
        rewards, parts = [r for r, _ in scored], [p for _, p in scored]
    if version > 0:
        model.unload()  # take the LoRA layers out again: the next version starts from the clean base
    return {"version": version, "task": task.name, "split": "eval", "n": n, "model": args.model,
            "accuracy": accuracy(parts), "reward_mean": sum(rewards) / n,
            "components": {k: sum(p[k] for p in parts) / n for k in parts[0]},
            "max_new_tokens": args.max_new_tokens, "eval_s": round(time.time() - t0, 2), "created_at": time.time(),
            "examples": [{"prompt": task.prompts[i], "answer": getattr(task, "answers", [None] * n)[i],
                          "completion": completions[i]} for i in range(min(3, n))]}


def evaluate_live(args: Args, task) -> dict:
    """Greedy answers of the live policy through the proxy, `batch_size` requests in flight."""
    client = ProxyClient(args.proxy_url, args.proxy_token, args.hf_token, patience_s=30.0)
    # a routed request waits for a worker's round to end: longer than ProxyClient's usual read timeout
    client.http.timeout = httpx.Timeout(10, read=args.live_wait_s)
    n = len(task.prompts) if args.limit <= 0 else min(args.limit, len(task.prompts))

    def ask(i: int) -> dict:
        return client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": task.prompts[i]}],
                                                     "max_tokens": args.max_new_tokens, "temperature": 0.0})
    t0 = time.time()
    with ThreadPoolExecutor(max(1, args.batch_size)) as pool:
        answers = list(pool.map(ask, range(n)))
    completions = [a["choices"][0]["message"]["content"] for a in answers]
    scored = [task.reward(c, i) for i, c in enumerate(completions)]
    parts = [p for _, p in scored]
    versions = Counter(a["adapter_version"] for a in answers)
    return {"live": True, "task": task.name, "split": "eval", "n": n, "proxy_url": args.proxy_url,
            "accuracy": accuracy(parts), "reward_mean": sum(r for r, _ in scored) / n,
            "components": {k: sum(p[k] for p in parts) / n for k in parts[0]},
            "adapter_versions": {str(v): c for v, c in sorted(versions.items())},
            "workers": sorted({a["worker_id"] for a in answers}), "max_new_tokens": args.max_new_tokens,
            "eval_s": round(time.time() - t0, 2), "created_at": time.time(),
            "examples": [{"prompt": task.prompts[i], "answer": task.answers[i], "completion": completions[i],
                          "adapter_version": answers[i]["adapter_version"]} for i in range(min(3, n))]}


def open_store(args: Args) -> Bucket | RunFolder | None:
    """Where the adapters are read and the results written: --run-dir's folder, the run's bucket (BUCKET set), or
    nowhere for the base model alone (--version 0), whose result is only printed."""
    if args.run_dir:
        return RunFolder(args.run_dir)
    if os.environ.get("BUCKET"):
        return Bucket()
    if args.version == 0 and not args.all:
        return None
    raise SystemExit("evaluate.py reads a run's adapters from its bucket (set BUCKET, RUN_NAME and S3_ENDPOINT_URL) or, "
                     "for a finished local run, from its folder: --run-dir runs/NAME (report.py saved its last adapter "
                     "there); --version 0, the base model, needs neither")


def where(bucket: Bucket | RunFolder) -> str:
    if isinstance(bucket, RunFolder):
        return (f"{bucket.root}/adapters/ (a local run saves its last version there; `bash launch_jobs.sh --local "
                "--keep-adapters all` saves every one)")
    return f"s3://{bucket.bucket}/{bucket.run}/"


def main(args: Args) -> None:
    if args.max_new_tokens is None:
        args = replace(args, max_new_tokens=token_budget(args.task))
    if args.live:
        if is_environment(args.task):
            raise SystemExit("--live sends single chat requests: an environment of several turns is evaluated "
                             "from the bucket's adapters (drop --live)")
        task = load_task(args.task, "eval")
        res = evaluate_live(args, task)
        if os.environ.get("BUCKET"):
            key = f"evals/live_{re.sub(r'[^A-Za-z0-9_.-]', '-', task.name)}_{int(res['created_at'])}.json"
            Bucket().put_json(key, res)
            print(f"written to {key}", file=sys.stderr)
        print(json.dumps({k: res[k] for k in ("task", "n", "accuracy", "reward_mean", "adapter_versions")}), flush=True)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--batch-size and --max-new-tokens must be >= 1")
    bucket = open_store(args)
    if bucket is not None:
        record_config(bucket, "evaluate", args, __file__)
    if args.task.startswith("verifiers:"):
        raise SystemExit("evaluate.py runs environments through rollout.py's episode runner; a verifiers environment "
                         "runs its own loop: evaluate it with verifiers' own `vf-eval` against the run's adapter")
    task = load_environment(args.task, "eval") if is_environment(args.task) else load_task(args.task, "eval")
    published = published_versions(bucket) if bucket is not None else []
    if args.all:
        versions = [0, *published]
    elif args.version < 0:
        versions = [published[-1] if published else 0]
    else:
        if args.version and args.version not in published:
            raise SystemExit(f"version {args.version} is not published in {where(bucket)} "
                             f"(published: {published or 'none'})")
        versions = [args.version]
    todo = [v for v in versions if args.overwrite or not args.all or bucket.get(result_key(v, task.name)) is None]
    # (no bucket: only --version 0, the base model, which has no meta.json to check)
    for v in todo:  # cheap checks first: before a model download, not after
        meta = bucket.get_json(f"{adapter_prefix(v)}/meta.json") if v else {}
        if meta is None or meta.get("base_model") not in (None, args.model):
            why = "no meta.json" if meta is None else f"trained on {meta['base_model']!r}, not {args.model!r}"
            raise SystemExit(f"not evaluating version {v}: {why}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, tok = load_base(args.model, args.dtype)
    base.to(device)
    for v in todo:
        print(f"evaluating version {v} on {task.name} ({len(task.prompts)} held-out prompts)", file=sys.stderr)
        try:
            res = evaluate(args, bucket, base, tok, task, v, device)
        except AdapterError as e:
            raise SystemExit(f"not evaluating version {v}: {e}") from e
        if bucket is not None:
            bucket.put_json(result_key(v, task.name), res)
        print(json.dumps({k: res[k] for k in ("version", "task", "n", "accuracy", "reward_mean")}), flush=True)
    if is_environment(args.task):
        task.close()  # an environment server it started
    if bucket is None:
        print("(no BUCKET and no --run-dir: the result is printed, not stored)", file=sys.stderr)
        return
    # the curve: every result of this task in the run
    curve = [(v, r) for v in [0, *published] if (r := bucket.get_json(result_key(v, task.name)))]
    print(curve_line(task.name, curve), file=sys.stderr)


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Args, args=script_args()))
