"""Environments: tasks of several turns, where the model's turn is answered by an environment (a tool, a
game, a verifier's loop) until the environment says done. rollout.py and evaluate.py drive them through
one episode runner (lib/rollout/episodes.py); tasks.py's single-turn tasks stay as they are.

    calculator          built in: multi-digit multiplication the local model cannot do in its head, and
                        a calculator it can call by replying with only the expression; reward 1 for the
                        right final answer (the local multi-turn demo: `bash launch_jobs.sh --local --task calculator`)
    reasoning-gym:NAME  any reasoning-gym dataset (`pip install reasoning-gym`), seeded and offline, scored
                        by its own scorer (and 0.1 for the tagged form it reads): reasoning-gym:chain_sum, ...
    openenv:URL         an OpenEnv environment server (openenv-core) at URL, or openenv:PATH.py:APP started
                        here on loopback (`openenv_env.py`); the contract is in `env_types.py`
    verifiers:ENV_ID    a verifiers environment run by its own loop (`verifiers_env.py`)

An environment gives, for prompt index i, the first chat messages (the group's shared prompt) and a fresh
`Session` per episode; a session answers each model turn with a `Step`: the messages the environment
adds (rendered by the chat template and appended to the episode as environment tokens, mask 0), whether
the episode is done, and, for an environment that keeps the conversation itself, its whole history, which
the runner checks against the tokens it has (re-tokenisation drift). The heavy libraries are imported
only when such a task is asked for, and a missing one is named with the command that installs it.
"""
from __future__ import annotations

import ast
import difflib
import operator
import random
import re

from env_types import Environment, Session, Step, require  # noqa: F401 - the contract, re-exported
from tasks import FORMAT_WEIGHT, unknown_task


# ----------------------------------------------------------------------------------------------
# calculator: the built-in tool task

# the prompt: one worked example of the protocol, on an addition, then the question. SmolLM2-135M answers
# multiplications from its head (wrongly) most of the time; with this example it calls the calculator in about
# a fifth of its episodes at the start (0.22 of 32 episodes, and 0.19 right, measured on the local model at T=1)
CALC_EXAMPLE = [{"role": "user", "content": "What is 23 + 45? Use the calculator: reply with only the expression, and the "
                                            "calculator replies with its value. Then reply with just the number."},
                {"role": "assistant", "content": "23 + 45"}, {"role": "user", "content": "= 68"},
                {"role": "assistant", "content": "68"}]
CALC_QUESTION = "What is {a} * {b}?"
# a model turn that is only an arithmetic expression (no answer after '=') is a call of the calculator
_CALL = re.compile(r"^\s*([\d\s+\-*/x×().]*\d[\d\s]*[+\-*/x×][\d\s+\-*/x×().]*\d[\s)]*)=?\s*$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calc(expr: str) -> str:
    """The calculator: + - * / // and brackets on integers and decimals, nothing else (no names, no
    powers: a tool must not be a way to hang the worker). Its answer, or what is wrong."""
    try:
        node = ast.parse(expr.replace("×", "*").replace("x", "*"), mode="eval").body
    except SyntaxError:
        return "error: not an expression"

    def ev(n):
        if isinstance(n, ast.Constant) and type(n.value) in (int, float):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.operand))
        raise ValueError("only numbers, + - * / and brackets")
    try:
        v = ev(node)
    except (ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return f"= {v}" if abs(v) < 1e15 else "error: too large"


class CalculatorSession(Session):
    """The model asks the calculator by replying with only an expression; any other reply is its answer."""

    def __init__(self, answer: int):
        self.answer, self.calls, self.final = answer, 0, ""

    def step(self, text: str) -> Step:
        if (m := _CALL.match(text.strip())) and self.calls < 3:
            self.calls += 1
            return Step([{"role": "user", "content": calc(m.group(1))}], done=False)
        self.final = text
        return Step([], done=True)

    def score(self) -> tuple[float, dict[str, float]]:
        nums = _NUMBER.findall(self.final)
        ok = bool(nums) and nums[-1].replace(",", "") == str(self.answer)
        return float(ok), {"correct": float(ok), "diag_tool_call": float(self.calls > 0)}


def calculator(seed: int = 0, split: str = "train") -> Environment:
    """a * b with a of 3 digits and b of 2: 2,000 training prompts and 200 held out, seeded."""
    rng = random.Random(seed)
    pairs = list(dict.fromkeys((rng.randint(100, 999), rng.randint(10, 99)) for _ in range(2400)))[:2200]
    pairs = pairs[:2000] if split == "train" else pairs[2000:]
    return Environment("calculator", [CALC_EXAMPLE + [{"role": "user", "content": CALC_QUESTION.format(a=a, b=b)}]
                                      for a, b in pairs],
                       lambda i: CalculatorSession(pairs[i][0] * pairs[i][1]), max_turns=3)


# ----------------------------------------------------------------------------------------------
# reasoning-gym: any of its procedural datasets, scored by its own scorer

RG_SIZE, RG_EVAL = 2000, 200  # prompts per split; the eval split is another seed, so no prompt is shared
RG_EXAMPLE_SEED = 2_000_003    # the worked example's entry comes from a seed neither split uses
# The prompt: reasoning-gym's "direct" system prompt (the answer alone, in <answer> tags) and one worked example of
# the dataset, answered in that form. Under its "default" prompt (think step by step, then the tags) SmolLM2-135M
# tagged none of 48 answers of 48 tokens on leg_counting and gcd, "direct" alone none either; with the example 42%
# and 27% (6 prompts x 8 at T=1): its scorer reads only a tagged answer, so untagged every reward is 0.
RG_SYSTEM = "direct"


class ReasoningGymSession(Session):
    def __init__(self, dataset, entry: dict, extract):
        self.dataset, self.entry, self.extract, self.text = dataset, entry, extract, ""

    def step(self, text: str) -> Step:
        self.text = text
        return Step([], done=True)

    def score(self) -> tuple[float, dict[str, float]]:
        """Its own scorer's reward, and FORMAT_WEIGHT (0.1) for an answer in the tags it reads, right or wrong, as
        tasks.py's gsm8k and math pay their format: a group that differs only in the form still teaches it."""
        answer = self.extract(self.text)
        r = float(self.dataset.score_answer(answer=answer, entry=self.entry))
        tagged = FORMAT_WEIGHT * float(answer is not None)
        return r + tagged, {"correct": r, "format": tagged}


def no_dataset(name: str, names: list[str]) -> str:
    """What reasoning-gym:NAME of no dataset is told: the nearest names (difflib), else the first of them all."""
    near = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return (f"reasoning-gym has no dataset {name!r}; " + (f"did you mean {', '.join(near)}? " if near else "")
            + f"its {len(names)} datasets: {', '.join(names[:12])}, ... (reasoning_gym.factory.DATASETS)")


def reasoning_gym(name: str, seed: int = 0, split: str = "train") -> Environment:
    rg = require("reasoning-gym")
    from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer
    try:
        ds = rg.create_dataset(name, size=RG_SIZE if split == "train" else RG_EVAL,
                               seed=seed if split == "train" else seed + 1_000_003)
    except (KeyError, ValueError) as e:
        raise SystemExit(no_dataset(name, sorted(rg.factory.DATASETS))) from None
    except (AssertionError, TypeError) as e:  # its config's own checks: a dataset that needs settings (composite)
        raise SystemExit(f"reasoning-gym:{name} cannot be made from its name alone ({type(e).__name__}: {e}): it "
                         "needs a configuration, which --task does not take; name a dataset of its own") from None
    entries = [ds[i] for i in range(len(ds))]
    shot = rg.create_dataset(name, size=1, seed=RG_EXAMPLE_SEED)[0]
    head = [{"role": "system", "content": SYSTEM_PROMPTS[RG_SYSTEM]}, {"role": "user", "content": shot["question"]},
            {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"}]
    return Environment(f"reasoning-gym-{name}", [head + [{"role": "user", "content": e["question"]}] for e in entries],
                       lambda i: ReasoningGymSession(ds, entries[i], extract_answer), max_turns=1)


# ----------------------------------------------------------------------------------------------


def is_environment(name: str) -> bool:
    return name == "calculator" or name.split(":", 1)[0] in ("reasoning-gym", "openenv", "verifiers")


def load_environment(name: str, split: str = "train", seed: int = 0, sessions: int = 0) -> Environment:
    """`calculator`, `reasoning-gym:NAME`, `openenv:URL` / `openenv:PATH.py:APP`, `verifiers:ENV_ID`. sessions:
    the episodes the caller runs at once (an OpenEnv server's lower limit is learnt: Environment.max_sessions)."""
    kind, _, rest = name.partition(":")
    if name == "calculator":
        return calculator(seed, split)
    if kind == "reasoning-gym" and rest:
        return reasoning_gym(rest, seed, split)
    if kind == "openenv" and rest:
        from openenv_env import openenv_environment
        return openenv_environment(rest, split, seed, sessions)
    if kind == "verifiers" and rest:
        raise SystemExit("verifiers environments run their own loop: rollout.py drives them through verifiers_env.py")
    raise SystemExit(unknown_task(name))
