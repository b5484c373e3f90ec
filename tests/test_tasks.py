"""Tasks and rewards (common.py section 5) on real GSM8K-style strings; no network: the GSM8K loader
is fed local rows through `datasets` itself, the jsonl task reads files written here."""
import json
import os
import sys

import pytest

import common
import tasks
from tasks import final_number, load_task, numbers, numeric_reward

# two answers as they appear in openai/gsm8k (train split), calculator annotations included
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A company pays $1,200 a week in rent. How much does it pay in 52 weeks?",
     "answer": "It pays 1,200*52 = $<<1200*52=62400>>62,400.\n#### 62,400"},
    {"question": "The temperature was 5 degrees and fell by 12 degrees. What is it now?",
     "answer": "5-12 = <<5-12=-7>>-7\n#### -7"},
]


@pytest.mark.parametrize("text,want", [
    ("It pays 1,200*52 = $62,400.", [1200, 52, 62400]),
    ("She has $18.50 left, i.e. 42% of 44 apples", [18.5, 42, 44]),
    ("5-12 = -7", [5, 12, -7]),
    ("x = \u22127", [-7]),                       # unicode minus
    ("1,2,3", [1, 2, 3]),                       # not a thousands separator
    ("pages 10-12.", [10, 12]),
    ("no digits here", []),
])
def test_numbers(text, want):
    assert numbers(text) == want


@pytest.mark.parametrize("text,want", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", 72),
    ("So the total is 62,400 dollars.\n#### 62,400 dollars", 62400),
    ("The answer is $1,234.50 per month, not 12.", 1234.5),
    ("It drops by 12 degrees: 5 - 12 = -7 degrees", -7),
    ("First 3 boxes, then 4 more: 7 boxes.", 7),        # several numbers: the final one counts
    ("#### 18 \n then I wrote 5 more", 18),              # the marker wins over a later number
    ("\\boxed{-3} hmm 10", -3),
    ("I do not know", None),
])
def test_final_number(text, want):
    assert final_number(text) == want


def test_gsm8k_rewards_keep_format_apart_from_correctness():
    gold = "62,400"
    right_fmt = numeric_reward("1200 * 52 = 62400\n#### 62,400", gold)
    right_nofmt = numeric_reward("It pays $62,400 in a year.", gold)
    wrong_fmt = numeric_reward("#### 62,000", gold)
    assert right_fmt == {"correct": 1.0, "format": tasks.FORMAT_WEIGHT}
    assert right_nofmt == {"correct": 1.0, "format": 0.0}
    assert wrong_fmt == {"correct": 0.0, "format": tasks.FORMAT_WEIGHT}
    assert numeric_reward("nothing", gold) == {"correct": 0.0, "format": 0.0}
    assert numeric_reward("#### -7", "-7")["correct"] == 1.0
    assert numeric_reward("#### 7", "-7")["correct"] == 0.0


def test_gsm8k_task_from_datasets(monkeypatch):
    """The real gsm8k_task code path, with `datasets.load_dataset` answering local rows instead of the Hub."""
    import datasets
    calls = []

    def local_gsm8k(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", local_gsm8k)
    train, test = load_task("gsm8k"), load_task("gsm8k", "eval")
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert train.name == "gsm8k" and train.answers == ["72", "62,400", "-7"]
    assert train.prompts[0].startswith("Natalia sold clips") and "####" in train.prompts[0]
    # the reference solutions themselves score full marks; a wrong final number does not
    for i, row in enumerate(GSM8K_ROWS):
        total, parts = train.reward(row["answer"], i)
        assert parts == {"correct": 1.0, "format": tasks.FORMAT_WEIGHT} and total == pytest.approx(1.1)
    assert test.reward("Natalia sold 24 in May, so 24 + 48 = 96.\n#### 96", 0) == (pytest.approx(0.1), {
        "correct": 0.0, "format": tasks.FORMAT_WEIGHT})


def test_task_reward_sums_components_but_not_diagnostics():
    t = load_task("addition")
    i = 0
    answer = t.answers[i]
    assert t.reward(answer, i) == (1.0, {"correct": 1.0, "diag_just_number": 1.0})
    assert t.reward(f"The sum is {answer}, I think.", i) == (1.0, {"correct": 1.0, "diag_just_number": 0.0})
    assert t.reward(f"{answer} or maybe {int(answer) + 1}", i)[0] == 0.0


def test_addition_eval_is_held_out():
    train, ev = load_task("addition"), load_task("addition", "eval")
    assert len(train.prompts) == 80 and len(ev.prompts) == 20
    assert not set(train.prompts) & set(ev.prompts)
    assert load_task("addition", "eval").prompts == ev.prompts  # deterministic


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return f"jsonl:{path}"


def test_jsonl_task_split_and_rewards(tmp_path):
    rows = [{"prompt": f"What is {i} times 3?", "answer": i * 3} for i in range(18)]
    rows += [{"prompt": "Capital of France?", "answer": "Paris"}, {"prompt": "Opposite of up?", "answer": "down"}]
    name = write_jsonl(tmp_path / "mine.jsonl", rows[:10] + [""] + rows[10:])  # blank lines are skipped
    train, ev = load_task(name), load_task(name, "eval")
    assert train.name == ev.name == "jsonl-mine"
    assert len(train.prompts) == 18 and len(ev.prompts) == 2       # the last tenth is held out
    assert ev.prompts == ["Capital of France?", "Opposite of up?"]
    assert train.reward("3 times 3 is 9.\n#### 9", 3) == (pytest.approx(1.1), {"correct": 1.0, "format": 0.1})
    assert ev.reward("The capital is Paris.\n#### Paris.", 0)[1] == {"correct": 1.0, "format": 0.1}
    assert ev.reward("It is\nDown", 1)[1] == {"correct": 1.0, "format": 0.0}   # last line, case-insensitive
    assert ev.reward("#### up", 1)[1]["correct"] == 0.0


@pytest.mark.parametrize("lines,msg", [
    (['{"prompt": "a", "answer": 1}', "{not json"], ":2: not valid JSON"),
    (['{"prompt": "a", "answer": 1}', '{"question": "b", "answer": 2}'], ':2: expected {"prompt"'),
    (['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": null}'], ':2: expected {"prompt"'),
    (['{"prompt": "a", "answer": 1}', '["prompt", "answer"]'], ':2: expected {"prompt"'),
    (['{"prompt": "a", "answer": 1}'], "need at least 2"),
])
def test_jsonl_bad_input(tmp_path, lines, msg):
    name = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(SystemExit, match=msg.replace("{", r"\{").replace("[", r"\[")):
        load_task(name)


def test_unknown_task_file_or_split(tmp_path):
    with pytest.raises(SystemExit, match="unknown task 'gsm9k'"):
        load_task("gsm9k")
    with pytest.raises(SystemExit, match="no such file"):
        load_task(f"jsonl:{tmp_path}/missing.jsonl")
    with pytest.raises(SystemExit, match="unknown split 'test'"):
        load_task("addition", "test")


@pytest.mark.parametrize("name, want", [
    ("calculater", "unknown task 'calculater'; did you mean 'calculator'?"),
    ("reasoning_gym:chain_sum", "unknown task 'reasoning_gym:chain_sum'; did you mean 'reasoning-gym:chain_sum'?"),
    ("openenvs:http://127.0.0.1:8001", "did you mean 'openenv:http://127.0.0.1:8001'?"),
    ("verifier", "did you mean 'verifiers:ENV_ID'?"),
    ("poetry", "unknown task 'poetry'. Tasks:"),
])
def test_an_unknown_task_lists_every_form_and_the_nearest(name, want):
    """rollout.py and evaluate.py resolve --task through is_environment, then load_environment or load_task: a
    misspelled task is told the nearest one there is and every form, environments included."""
    import environments
    load = environments.load_environment if environments.is_environment(name) else load_task
    with pytest.raises(SystemExit) as e:
        load(name)
    assert want in str(e.value)
    assert str(e.value).endswith("Tasks: addition, gsm8k, math, jsonl:PATH (one turn); calculator, "
                                 "reasoning-gym:DATASET, openenv:URL or openenv:PATH.py:APP, verifiers:ENV_ID "
                                 "(environments of several turns: docs/environments.md)")


def test_script_args_drop_files_shipped_beside_the_script(tmp_path, monkeypatch):
    """`hf jobs uv run rollout.py common.py --x 1` runs `uv run /data/rollout.py /data/common.py --x 1`."""
    for f in ("rollout.py", "common.py", "data.jsonl"):
        (tmp_path / f).write_text("")
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "rollout.py"), str(tmp_path / "common.py"),
                                      str(tmp_path / "data.jsonl"), "--task", "jsonl:/data/data.jsonl"])
    assert common.script_args() == ["--task", "jsonl:/data/data.jsonl"]
    # a file elsewhere, or a shipped file after the first option, is an argument and stays
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "common.py").write_text("")
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "rollout.py"), str(other / "common.py"), "--x", "1"])
    assert common.script_args() == [str(other / "common.py"), "--x", "1"]
    assert common.script_args(["--out", str(tmp_path / "common.py")]) == ["--out", str(tmp_path / "common.py")]
    assert os.path.isfile(tmp_path / "common.py")


# --- math-verify: real MATH- and GSM8K-style answers -------------------------------------------
# (completion, reference answer, correct?, what the number regex alone said: the verdict of tasks.py
# before math-verify, where GSM8K used final_number and a non-numeric answer compared the last line as text)
MATH_CASES = [   # MATH-500 and MATH train style: the reference is LaTeX without $
    (r"so $r = 3$ and $\theta = \frac{\pi}{2}$. The answer is $\boxed{\left( 3, \frac{\pi}{2} \right)}$.",
     r"\left( 3, \frac{\pi}{2} \right)", True, False),                                  # a tuple with pi
    (r"$f(-2)+f(-1)+f(0) = 2 + \frac{5}{3} + 1 = \boxed{\frac{14}{3}}$", r"\frac{14}{3}", True, False),
    (r"$\boxed{\dfrac{28}{6}}$", r"\frac{14}{3}", True, False),                          # unreduced fraction
    (r"so the sum is $\boxed{4\frac{2}{3}}$", r"\frac{14}{3}", True, False),             # mixed number
    (r"$\boxed{\frac{13}{3}}$", r"\frac{14}{3}", False, False),
    (r"The hypotenuse is $\boxed{\sqrt{8}}$.", r"2\sqrt{2}", True, False),               # roots
    (r"$\boxed{0.5}$", r"\frac{1}{2}", True, False),
    (r"The domain is $\boxed{[2,5)}$.", "[2,5)", True, False),                          # intervals
    (r"The domain is $\boxed{[2,5]}$.", "[2,5)", False, False),
    (r"$x\in\boxed{(-\infty,-3)\cup(3,\infty)}$", r"(-\infty,-3)\cup(3,\infty)", True, False),
    (r"$\boxed{\{1,2,3\}}$", r"\{3,2,1\}", True, False),                                  # sets, any order
    (r"The solutions are $\boxed{-2, 1}$.", "1,-2", True, False),
    (r"The side is $\boxed{5\text{ cm}}$.", "5", True, True),                            # units
    (r"The angle is $\boxed{90^\circ}$.", "90", True, True),
    (r"First I thought 12, but the answer is $\boxed{27}$.", "27", True, True),
    (r"I am not sure.", r"\frac{14}{3}", False, False),
]
GSM8K_CASES = [
    ("Half of 14 is 14/2.\n#### 14/2", "7", True, False),                               # a fraction after ####
    ("The answer is 5 \\times 3 = 15", "15", True, False),                               # an expression, then its value
    ("Each gets $\\frac{24}{3} = 8$ cookies.\n#### \\frac{24}{3}", "8", True, False),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", True, True),
    ("It pays $62,400 in a year.", "62,400", True, True),
    ("#### 62,000", "62,400", False, False),
    ("#### 18 \n then I wrote 5 more", "18", True, True),                               # the #### line wins
    ("I do not know", "18", False, False),
]


def regex_verdict(completion: str, answer: str) -> bool:
    """What the regex-only scoring said (tasks.py before math-verify): numbers via final_number, anything
    else the last line as text."""
    if tasks._NUM.fullmatch(answer.strip()):
        pred, gold = final_number(completion), final_number(answer)
        return pred is not None and gold is not None and abs(pred - gold) < 1e-6
    last = completion.rsplit("####", 1)[-1] if "####" in completion else completion.strip().splitlines()[-1]
    return " ".join(last.lower().split()).strip(" .") == " ".join(answer.lower().split()).strip(" .")


@pytest.mark.parametrize("completion,answer,right,regex", MATH_CASES)
def test_math_answers_verified(completion, answer, right, regex):
    assert tasks.math_reward(completion, answer)["correct"] == float(right)
    if answer != "1,-2":   # a jsonl task with such answers ("1,-2" has no LaTeX or bracket: compared as text)
        assert tasks.text_reward(completion, answer)["correct"] == float(right)
    assert regex_verdict(completion, answer) == regex


@pytest.mark.parametrize("completion,answer,right,regex", GSM8K_CASES)
def test_gsm8k_answers_verified(completion, answer, right, regex):
    assert numeric_reward(completion, answer)["correct"] == float(right)
    assert regex_verdict(completion, answer) == regex


def test_the_regex_alone_got_these_wrong():
    """The project's number parser alone (tasks.final_number and tasks._NUM, what scored answers before
    math-verify and still does when math-verify reads nothing) gets 13 of the cases above wrong (10
    MATH-style, 3 GSM8K-style), and the project's rewards get every one of them right. Computed here
    from the project's code on each case, not read from the tables' last column."""
    regex_wrong = {"math": [], "gsm8k": []}
    for kind, cases, reward in (("math", MATH_CASES, tasks.math_reward), ("gsm8k", GSM8K_CASES, numeric_reward)):
        for completion, answer, right, _ in cases:
            assert reward(completion, answer)["correct"] == float(right), (completion, answer)
            if regex_verdict(completion, answer) != right:
                regex_wrong[kind].append(completion)
    assert (len(regex_wrong["math"]), len(regex_wrong["gsm8k"])) == (10, 3), regex_wrong
    # the GSM8K ones, straight from the parser: the number it reads is not the answer (7, 15, 8)
    assert [final_number(c) for c in regex_wrong["gsm8k"]] == [14, 5, 24]


def test_math_format_is_separate_from_correctness():
    assert tasks.math_reward(r"so $\boxed{3}$", "3") == {"correct": 1.0, "format": tasks.FORMAT_WEIGHT}
    assert tasks.math_reward("so it is 3", "3") == {"correct": 1.0, "format": 0.0}
    assert tasks.math_reward(r"$\boxed{4}$", "3") == {"correct": 0.0, "format": tasks.FORMAT_WEIGHT}
    assert tasks.last_boxed(r"a \boxed{\frac{1}{2}} then \boxed{\{1, 2\}}.") == r"\{1, 2\}"
    assert tasks.last_boxed(r"\boxed{unclosed") is None


def test_math_verify_works_off_the_main_thread():
    """Its timeouts use SIGALRM (main thread only): elsewhere they are off instead of raising."""
    import threading
    out = {}
    t = threading.Thread(target=lambda: out.update(r=tasks.math_reward(r"$\boxed{\sqrt{8}}$", r"2\sqrt{2}")))
    t.start()
    t.join(60)
    assert out["r"]["correct"] == 1.0


# three MATH-style rows (problem, solution with \boxed{}) and a MATH-500 row that is one of them
MATH_ROWS = [
    {"problem": "What is the value of $\\sqrt{36 \\times \\sqrt{16}}$?",
     "solution": "$\\sqrt{36 \\times \\sqrt{16}} = \\sqrt{36 \\times 4} = \\sqrt{144} = \\boxed{12}$."},
    {"problem": "Find the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.",
     "solution": "We need $x-2 \\ge 0$ and $5-x>0$, so the domain is $\\boxed{[2,5)}$."},
    {"problem": "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? Express your answer "
                "as a common fraction.",
     "solution": "$f(-2)+f(-1)+f(0)=\\frac{-8}{-4}+\\frac{-5}{-3}+\\frac{-2}{-2}=2+\\frac{5}{3}+1=\\boxed{\\frac{14}{3}}$"},
]
MATH500_ROWS = [{"problem": "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$? Express "
                            "your answer as a common fraction.", "answer": "\\frac{14}{3}", "subject": "Algebra"}]


def test_math_task_from_datasets(monkeypatch):
    """The real math_task code path, `datasets.load_dataset` answering local rows instead of the Hub:
    training never sees a MATH-500 problem, answers come from the solutions' last \\boxed{}."""
    import datasets
    calls = []

    def local(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(MATH500_ROWS if path == tasks.MATH_500 else MATH_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", local)
    train, ev = load_task("math"), load_task("math", "eval")
    assert calls[:2] == [(tasks.MATH_500, None, "test"), (tasks.MATH_ALL, "default", "train+test")]
    assert train.answers == ["12", "[2,5)"] and ev.answers == ["\\frac{14}{3}"]
    assert "\\boxed{}" in train.prompts[0] and not set(train.prompts) & set(ev.prompts)
    for i, row in enumerate(MATH_ROWS[:2]):   # the reference solutions score full marks
        assert train.reward(row["solution"], i) == (pytest.approx(1.1), {"correct": 1.0, "format": 0.1})
    assert ev.reward(MATH_ROWS[2]["solution"], 0)[1]["correct"] == 1.0
    assert ev.reward("$\\boxed{\\frac{5}{3}}$", 0)[1] == {"correct": 0.0, "format": 0.1}


def test_jsonl_task_from_the_bucket(bucket, run_name):
    """`jsonl:s3://BUCKET/KEY`: a worker reads the prompts the launcher uploaded; no local file."""
    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(10)]
    bucket.put("prompts/sums.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    url = f"s3://{bucket.bucket}/{run_name}/prompts/sums.jsonl"
    train, ev = load_task(f"jsonl:{url}"), load_task(f"jsonl:{url}", "eval")
    assert train.name == "jsonl-sums" and len(train.prompts) == 9 and ev.prompts == ["What is 9 + 1?"]
    assert train.reward("#### 1", 0)[1] == {"correct": 1.0, "format": 0.1}
    with pytest.raises(SystemExit, match="no such object in the bucket"):
        load_task(f"jsonl:s3://{bucket.bucket}/{run_name}/prompts/other.jsonl")
    with pytest.raises(SystemExit, match="expected s3://BUCKET/KEY"):
        load_task("jsonl:s3://only-a-bucket")
    bucket.put("prompts/bad.jsonl", b'{"prompt": "a", "answer": 1}\n{oops\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: not valid JSON"):
        load_task(f"jsonl:s3://{bucket.bucket}/{run_name}/prompts/bad.jsonl")


def test_every_task_kind_has_a_token_budget_and_an_unknown_task_is_named():
    """--max-new-tokens when none is given (rollout.py, evaluate.py, the launchers): one rule, by the task's kind."""
    from tasks import TASK_KINDS, PLAIN_TASKS, token_budget
    assert [token_budget(t) for t in ("addition", "calculator", "gsm8k", "reasoning-gym:leg_counting",
                                      "jsonl:data/x.jsonl", "openenv:http://h:8000")] == [24, 24, 512, 64, 256, 128]
    assert all(token_budget(t) > 0 for t in PLAIN_TASKS + [f"{k}:x" for k in TASK_KINDS])
    with pytest.raises(SystemExit, match="unknown task 'reasoning_gym:leg_counting'; did you mean "
                                         "'reasoning-gym:leg_counting'"):
        token_budget("reasoning_gym:leg_counting")
