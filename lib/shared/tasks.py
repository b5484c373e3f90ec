"""Tasks: a prompt list + a reward function returning named components (their sum is the reward;
components named "diag_*" are logged only). Built in: `addition` (the local demo), `gsm8k`
(openai/gsm8k), `math` (MATH from the Hub, scored with math-verify) and `jsonl:PATH` (your data; PATH
may be `s3://BUCKET/KEY`). `load_task` is the entry point; rollout.py and evaluate.py use it, and it
travels with them to HF Jobs like common.py.

Answers are checked by math-verify (Hugging Face's verifier: LaTeX and plain answers parsed to sympy,
compared for equivalence: 14/2 = 7, \\frac{2}{4} = 0.5, \\sqrt{8} = 2\\sqrt{2}, intervals, sets,
units dropped). Its timeouts use SIGALRM, which Python allows only in the main thread: there they
are on (5 s), elsewhere off. The hand-written number regex remains for the addition demo and as the
fallback when math-verify finds no answer at all.
"""
from __future__ import annotations

import difflib
import json
import os
import random
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable


@dataclass
class Task:
    name: str
    prompts: list[str]          # user messages
    answers: list[str]          # reference answers, same order
    reward_fn: Callable[[str, str], dict[str, float]]

    def reward(self, completion: str, index: int) -> tuple[float, dict[str, float]]:
        parts = self.reward_fn(completion, self.answers[index])
        return float(sum(v for k, v in parts.items() if not k.startswith("diag_"))), parts


# ----------------------------------------------------------------------------------------------
# numbers the way people write them (the addition demo, and the fallback when math-verify finds nothing)

# a number as people write it: "-3", "1,234.5", "$18" and "42%" (the unit is left out); "3-4" is 3 and 4
_NUM = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_FINAL = re.compile(r"####\s*\$?\s*-?\d")  # the requested final-answer format: "#### 42"
FORMAT_WEIGHT = 0.1  # format reward, kept separate from correctness so each is logged on its own


def numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in _NUM.findall(text.replace("\u2212", "-"))]


def final_number(text: str) -> float | None:
    """The answer a text ends on: the first number after the last '####' (or '\\boxed{', 'answer is'),
    else the last number at all (the last, not any: listing every number must not score)."""
    for marker in ("####", "\\boxed{", "answer is"):
        if (i := text.rfind(marker)) >= 0 and (nums := numbers(text[i + len(marker):])):
            return nums[0]
    return (numbers(text) or [None])[-1]


# ----------------------------------------------------------------------------------------------
# math-verify


def _timeout_s() -> int | None:
    """math-verify times out through SIGALRM, which only the main thread may set."""
    return 5 if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=1 << 16)
def _gold(answer: str) -> tuple:
    """A reference answer (LaTeX without $, or a plain number) parsed once: boxed, so math-verify
    reads all of it ("(-\\infty, 3]", "62,400", "5\\text{ cm}")."""
    from math_verify import LatexExtractionConfig, parse
    return tuple(parse(f"\\boxed{{{answer}}}", [LatexExtractionConfig()], parsing_timeout=_timeout_s()))


def math_equal(answer: str, text: str) -> bool | None:
    """Whether `text` ends on an answer equivalent to the reference `answer`; None when math-verify
    reads no answer in one of them (the caller decides what that means)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    gold = list(_gold(answer))
    # a \boxed{} answer wins over the last expression in the text
    pred = parse(text, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                 parsing_timeout=_timeout_s())
    if not gold or not pred:
        return None
    return verify(gold, pred, timeout_seconds=_timeout_s())


def numeric_reward(completion: str, answer: str) -> dict[str, float]:
    """GSM8K-style: the answer is what follows the last '####' (on that line), else the text's final
    answer; math-verify compares it with the reference, the number regex only when it reads nothing."""
    region = completion.rsplit("####", 1)[1].split("\n", 1)[0] if "####" in completion else completion
    ok = math_equal(answer, region)
    if ok is None:
        pred, gold = final_number(region), final_number(answer)
        ok = pred is not None and gold is not None and abs(pred - gold) < 1e-6
    return {"correct": float(ok), "format": FORMAT_WEIGHT * float(_FINAL.search(completion) is not None)}


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (braces balanced), as MATH solutions give their answer."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, start = 0, i + len("\\boxed{")
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth < 0:
            return text[start:j].strip()
    return None


def math_reward(completion: str, answer: str) -> dict[str, float]:
    """MATH: `correct` when math-verify finds the completion's final (preferably boxed) answer
    equivalent to the reference; `format` (0.1) for giving one in \\boxed{}, right or wrong."""
    return {"correct": float(bool(math_equal(answer, completion))),
            "format": FORMAT_WEIGHT * float(last_boxed(completion) is not None)}


# ----------------------------------------------------------------------------------------------
# tasks


def addition_reward(completion: str, answer: str) -> dict[str, float]:
    """1 when the last number in the completion is the sum; `diag_just_number` tracks the format."""
    nums = numbers(completion)
    return {"correct": float(bool(nums) and nums[-1] == float(answer)),
            "diag_just_number": float(completion.strip().rstrip(".") == answer)}


def addition_task(seed: int = 0, split: str = "train") -> Task:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    pairs = pairs[:80] if split == "train" else pairs[80:]  # 20 held-out sums for evaluate.py
    return Task("addition", [f"What is {a} + {b}? Answer with just the number." for a, b in pairs],
                [str(a + b) for a, b in pairs], addition_reward)


GSM8K_PROMPT = "{}\nSolve it step by step, then give the final answer as a plain number after '####'."


def gsm8k_task(split: str = "train") -> Task:
    """openai/gsm8k from the Hub (cached by `datasets`); its answers end in '#### <number>'."""
    from datasets import load_dataset
    ds = load_dataset("openai/gsm8k", "main", split="train" if split == "train" else "test")
    return Task("gsm8k", [GSM8K_PROMPT.format(q) for q in ds["question"]],
                [a.rsplit("####", 1)[-1].strip() for a in ds["answer"]], numeric_reward)


MATH_PROMPT = "{}\nSolve it step by step, then put the final answer in \\boxed{{}}."
MATH_ALL = "DigitalLearningGmbH/MATH-lighteval"   # Hendrycks' MATH: 7,500 train + 5,000 test problems
MATH_500 = "HuggingFaceH4/MATH-500"               # the 500 test problems of "Let's Verify Step by Step"


def _norm_problem(p: str) -> str:
    return " ".join(p.split())


def math_task(split: str = "train") -> Task:
    """MATH. eval: MATH-500; train: the other 12,000 problems of MATH (its train and test splits
    without MATH-500's, as in PRM800K), so evaluation never sees a training problem. The reference
    answer of a training problem is the last \\boxed{} of its solution."""
    from datasets import load_dataset
    held_out = load_dataset(MATH_500, split="test")
    if split != "train":
        return Task("math", [MATH_PROMPT.format(p) for p in held_out["problem"]], list(held_out["answer"]), math_reward)
    exclude = {_norm_problem(p) for p in held_out["problem"]}
    ds = load_dataset(MATH_ALL, "default", split="train+test")
    rows = [(p, last_boxed(s)) for p, s in zip(ds["problem"], ds["solution"]) if _norm_problem(p) not in exclude]
    rows = [(p, a) for p, a in rows if a]  # a handful of solutions state the answer without \boxed{}
    return Task("math", [MATH_PROMPT.format(p) for p, _ in rows], [a for _, a in rows], math_reward)


_MATHY = re.compile(r"[\\^{}()\[\]]")


def text_reward(completion: str, answer: str) -> dict[str, float]:
    """Numeric answers as GSM8K; math answers (LaTeX or brackets: \\frac{1}{2}, [2,5), x^2) as MATH;
    other answers: the text after '####' (else the last line), case-insensitive."""
    if _NUM.fullmatch(answer.strip().replace("\u2212", "-")):
        return numeric_reward(completion, answer)
    if _MATHY.search(answer):
        return math_reward(completion, answer)
    got = completion.rsplit("####", 1)[-1] if "####" in completion else (completion.strip().splitlines() or [""])[-1]
    norm = lambda s: " ".join(s.lower().split()).strip(" .")  # noqa: E731
    return {"correct": float(norm(got) == norm(answer)), "format": FORMAT_WEIGHT * float("####" in completion)}


def read_jsonl_source(path: str) -> str:
    """The text of a local file, or of `s3://BUCKET/KEY` read with this job's S3 endpoint and keys
    (common.Bucket's client: retries, the HF gateway's settings); the launcher uploads prompts there."""
    if not path.startswith("s3://"):
        if not os.path.isfile(path):
            raise SystemExit(f"task jsonl:{path}: no such file")
        return Path(path).read_text()
    from botocore.exceptions import BotoCoreError, ClientError

    from common import Bucket
    name, _, key = path[len("s3://"):].partition("/")
    if not name or not key:
        raise SystemExit(f"task jsonl:{path}: expected s3://BUCKET/KEY")
    s3 = Bucket(bucket=name, run="-").s3   # any key of the bucket, not one under a run's prefix
    try:
        return s3.get_object(Bucket=name, Key=key)["Body"].read().decode()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            raise SystemExit(f"task jsonl:{path}: no such object in the bucket") from None
        raise SystemExit(f"task jsonl:{path}: {e}") from e
    except BotoCoreError as e:
        raise SystemExit(f"task jsonl:{path}: {e}") from e


def parse_jsonl(text: str, source: str) -> list[tuple[str, str]]:
    """(prompt, answer) rows of a JSONL task, or a SystemExit naming the line that is wrong."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{source}:{n}: not valid JSON: {e}") from e
        if not (isinstance(r, dict) and isinstance(r.get("prompt"), str) and r["prompt"].strip()
                and type(r.get("answer")) in (str, int, float)):
            raise SystemExit(f'{source}:{n}: expected {{"prompt": "...", "answer": "..." or a number}}')
        rows.append((r["prompt"], str(r["answer"])))
    if len(rows) < 2:
        raise SystemExit(f"{source}: {len(rows)} rows; need at least 2 (the last tenth is held out for evaluation)")
    return rows


def jsonl_task(path: str, split: str = "train") -> Task:
    """User data: one {"prompt": str, "answer": str | number} per line; the last tenth is held out.
    `path` is a local file or s3://BUCKET/KEY; the task's name comes from the file name either way."""
    rows = parse_jsonl(read_jsonl_source(path), path)
    k = len(rows) - max(1, len(rows) // 10)
    rows = rows[:k] if split == "train" else rows[k:]
    return Task(f"jsonl-{Path(path).stem}", [p for p, _ in rows], [a for _, a in rows], text_reward)


def load_task(name: str, split: str = "train") -> Task:
    """`addition`, `gsm8k`, `math` or `jsonl:PATH` (PATH may be s3://BUCKET/KEY); split "eval" is held
    out from "train" (GSM8K: its test split; MATH: MATH-500)."""
    if split not in ("train", "eval"):
        raise SystemExit(f"unknown split {split!r}: train or eval")
    if name == "addition":
        return addition_task(split=split)
    if name == "gsm8k":
        return gsm8k_task(split)
    if name == "math":
        return math_task(split)
    if name.startswith("jsonl:"):
        return jsonl_task(name[len("jsonl:"):], split)
    raise SystemExit(unknown_task(name))


# Tokens a model turn may take when no --max-new-tokens is given, by task kind: the one rule rollout.py,
# evaluate.py and the launchers use (`bash launch_jobs.sh` prints the value it passes). Too few and every answer is
# cut before it is given: reasoning-gym at 24 tokens cut 228 of 256 answers, every reward 0, nothing trained.
TOKEN_BUDGETS = {
    "addition": 24,        # the answer is a number; the local run learns at 24 (docs/results/learning.md)
    "calculator": 24,      # per turn: an expression, or a number
    "gsm8k": 512,          # a worked solution takes a few hundred tokens
    "math": 512,
    "reasoning-gym": 64,   # the prompt asks for the answer alone in <answer> tags (environments.reasoning_gym)
    "jsonl": 256,          # your data: unknown, room for a few sentences
    "openenv": 128,        # per turn of an environment we do not know: an action, a short reply
    "verifiers": 256,
}


def token_budget(task: str) -> int:
    """--max-new-tokens when none is given: the budget of the task's kind (TOKEN_BUDGETS)."""
    kind = task if task in TOKEN_BUDGETS else task.partition(":")[0]
    if kind not in TOKEN_BUDGETS:
        raise SystemExit(unknown_task(task))
    return TOKEN_BUDGETS[kind]


PLAIN_TASKS = ["addition", "gsm8k", "math", "calculator"]
TASK_KINDS = {"jsonl": "PATH", "reasoning-gym": "DATASET", "openenv": "URL", "verifiers": "ENV_ID"}  # KIND:WHAT


def near_task(name: str) -> str | None:
    """The task `name` was likely meant to be (difflib), or None: a plain name by its spelling (calculater:
    calculator), a KIND:WHAT by its kind, WHAT kept (reasoning_gym:chain_sum: reasoning-gym:chain_sum)."""
    kind, colon, rest = name.partition(":")
    if colon:
        near = difflib.get_close_matches(kind.lower(), list(TASK_KINDS), n=1, cutoff=0.6)
        return f"{near[0]}:{rest}" if near else None
    near = difflib.get_close_matches(name.lower(), PLAIN_TASKS + list(TASK_KINDS), n=1, cutoff=0.6)
    return (near[0] if near[0] in PLAIN_TASKS else f"{near[0]}:{TASK_KINDS[near[0]]}") if near else None


def unknown_task(name: str) -> str:
    """What a --task nothing knows is told: the nearest task if one is near, and every form a task takes."""
    near = near_task(name)
    return (f"unknown task {name!r}" + (f"; did you mean {near!r}?" if near else ".") + " Tasks: addition, gsm8k, math, "
            "jsonl:PATH (one turn); calculator, reasoning-gym:DATASET, openenv:URL or openenv:PATH.py:APP, "
            "verifiers:ENV_ID (environments of several turns: docs/environments.md)")
