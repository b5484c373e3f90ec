"""Tasks: a prompt list + a reward function returning named components (their sum is the reward;
components named "diag_*" are logged only). Built in: `addition` (the local demo), `gsm8k`
(openai/gsm8k from the Hub, production) and `jsonl:PATH` (your data). `load_task` is the entry point;
rollout.py and evaluate.py use it, and it travels with them to HF Jobs like common.py.
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
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


def numeric_reward(completion: str, answer: str) -> dict[str, float]:
    pred, gold = final_number(completion), final_number(answer)
    return {"correct": float(pred is not None and gold is not None and abs(pred - gold) < 1e-6),
            "format": FORMAT_WEIGHT * float(_FINAL.search(completion) is not None)}


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


def text_reward(completion: str, answer: str) -> dict[str, float]:
    """Numeric answers as GSM8K; others: the text after '####' (else the last line), case-insensitive."""
    if _NUM.fullmatch(answer.strip().replace("\u2212", "-")):
        return numeric_reward(completion, answer)
    got = completion.rsplit("####", 1)[-1] if "####" in completion else (completion.strip().splitlines() or [""])[-1]
    norm = lambda s: " ".join(s.lower().split()).strip(" .")  # noqa: E731
    return {"correct": float(norm(got) == norm(answer)), "format": FORMAT_WEIGHT * float("####" in completion)}


def jsonl_task(path: str, split: str = "train") -> Task:
    """User data: one {"prompt": str, "answer": str | number} per line; the last tenth is held out."""
    if not os.path.isfile(path):
        raise SystemExit(f"task jsonl:{path}: no such file")
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not valid JSON: {e}") from e
        if not (isinstance(r, dict) and isinstance(r.get("prompt"), str) and r["prompt"].strip()
                and type(r.get("answer")) in (str, int, float)):
            raise SystemExit(f'{path}:{n}: expected {{"prompt": "...", "answer": "..." or a number}}')
        rows.append((r["prompt"], str(r["answer"])))
    if len(rows) < 2:
        raise SystemExit(f"{path}: {len(rows)} rows; need at least 2 (the last tenth is held out for evaluation)")
    k = len(rows) - max(1, len(rows) // 10)
    rows = rows[:k] if split == "train" else rows[k:]
    return Task(f"jsonl-{Path(path).stem}", [p for p, _ in rows], [a for _, a in rows], text_reward)


def load_task(name: str, split: str = "train") -> Task:
    """`addition`, `gsm8k` or `jsonl:PATH`; split "eval" is held out from "train" (GSM8K: its test split)."""
    if split not in ("train", "eval"):
        raise SystemExit(f"unknown split {split!r}: train or eval")
    if name == "addition":
        return addition_task(split=split)
    if name == "gsm8k":
        return gsm8k_task(split)
    if name.startswith("jsonl:"):
        return jsonl_task(name[len("jsonl:"):], split)
    raise SystemExit(f"unknown task {name!r}; built in: addition, gsm8k, jsonl:PATH")
