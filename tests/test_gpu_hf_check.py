"""bench/gpu_hf_check.py's two passes (docs/gpu.md) fit the device tool: each pass's items, by the
check's own estimates, fit its budget after the setup; each timeout_s fits one command, and the
session's device time holds both passes, or one pass and a rerun of it. The documented calls name
the machine kind the estimates were made for and the check's own timeouts; docs/gpu.md's table of
estimates is the check's. A bad --pass is refused before anything is installed or run."""
import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT

# /work/.library/device/README.md: a session's device time (the machine's start included) and one
# command's limit; a start takes "a minute or more", two at most when it is retried
DEVICE_S, COMMAND_S, START_S = 900, 600, 120
# before the first item: the .sh installs the carried wheels, verifies the stack, and the check
# imports torch and transformers (the CPU rehearsal on 5446985 reached its first item at 22 and 23 s;
# the GPU machine's time for it is not known)
SETUP_S = 30
KIND = "nvidia-h200"  # the card EST was written for
CALL = re.compile(r'run\(command="bash bench/gpu_hf_check\.sh --pass (\d)"(?P<rest>[^)]*)\)')


@pytest.fixture(scope="module")
def check() -> dict:
    """The check's constants and plans, read in a process of their own (importing it sets the
    offline variables of Hugging Face)."""
    code = ("import json, sys; sys.path.insert(0, 'bench'); import gpu_hf_check as g\n"
            "b, f = g.BF16_MODELS.split(','), g.FOUR_BIT_MODELS.split(',')\n"
            "ps = {p: [p] for p in g.TIMEOUT_S} | {'all': list(g.TIMEOUT_S)}\n"
            "print(json.dumps({'timeout': g.TIMEOUT_S, 'margin': g.BUDGET_MARGIN_S, 'deadline': g.DEADLINE_S,\n"
            "  'plan': {k: [f'{m} {it}' for _, m, it in g.plan(v, b, f)] for k, v in ps.items()},\n"
            "  'estimate': {k: g.plan_estimate(g.plan(v, b, f)) for k, v in ps.items()}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_the_passes_hold_the_items_the_issue_names(check):
    bf16 = ["0.5B", "1.5B", "7B"]
    assert check["plan"]["1"] == [f"{m} {it}" for m in bf16 for it in ("train_on", "sampler", "logprobs")]
    assert check["plan"]["2"] == [f"{m} train_off" for m in bf16] + ["7B train_4bit", "14B train_4bit"]
    assert check["plan"]["all"] == check["plan"]["1"] + check["plan"]["2"]
    assert check["estimate"]["1"] <= 300  # pass 1: at most about 300 s on the GPU (issue 48)


def test_each_pass_fits_one_command_and_the_session(check):
    t = check["timeout"]
    assert check["deadline"] < check["margin"]  # the hard exit comes after the budget
    for p, timeout in t.items():
        assert timeout <= COMMAND_S
        assert check["estimate"][p] + SETUP_S <= timeout - check["margin"], f"pass {p}: its items do not fit its budget"
        assert START_S + 2 * timeout <= DEVICE_S, f"pass {p}: no time to rerun it"
    assert START_S + sum(t.values()) <= DEVICE_S


@pytest.mark.parametrize("doc", ["docs/gpu.md", "bench/gpu_hf_check.sh"])
def test_the_documented_calls_name_the_kind_and_the_timeouts(check, doc):
    calls = {m[1]: m["rest"] for m in CALL.finditer((ROOT / doc).read_text())}
    assert set(calls) == set(check["timeout"]), f"{doc}: one call per pass"
    for p, rest in calls.items():
        assert f'kind="{KIND}"' in rest and 'carry=["wheels-gpu"]' in rest, f"{doc}, pass {p}: {rest}"
        assert re.search(r"timeout_s=(\d+)", rest)[1] == str(check["timeout"][p]), f"{doc}, pass {p}: {rest}"


def test_the_docs_table_of_passes_is_the_checks(check):
    """docs/gpu.md's rows `| pass | items | estimated s | timeout_s | budget s |`."""
    rows = re.findall(r"(?m)^\| (\d) \| [^|]+ \| (\d+) \| (\d+) \| (\d+) \|$", (ROOT / "docs" / "gpu.md").read_text())
    assert {p: (int(e), int(t), int(b)) for p, e, t, b in rows} == {
        p: (check["estimate"][p], t, t - check["margin"]) for p, t in check["timeout"].items()}


def test_a_bad_pass_is_refused():
    sh = subprocess.run(["bash", "bench/gpu_hf_check.sh", "--cpu-smoke", "--pass", "3"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert sh.returncode == 2 and "--pass takes 1, 2 or all, not '3'" in sh.stderr
    py = subprocess.run([sys.executable, "bench/gpu_hf_check.py", "--cpu-smoke", "--pass", "3"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert py.returncode == 2 and "argument --pass: invalid choice: '3'" in py.stderr
