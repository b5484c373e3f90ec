"""A worker on the hf backend handed a version whose LoRA has another shape than the one it serves (the trainer
restarted with another --lora-r, say): it refuses that version, says which and why, and keeps generating with
the adapter it has; it does not die. A real worker process, the real proxy, the moto bucket, the tiny model."""
import os
import re
import subprocess
import sys
import time

import common
import train
from conftest import ROOT, stop


def test_worker_refuses_an_adapter_of_another_rank_and_keeps_its_own(tiny_model, start_proxy, bucket, run_name,
                                                                      tmp_path):
    proxy = start_proxy("--group-size", "4")

    def publish(v: int, r: int) -> None:
        model, _ = train.build_model(train.Args(model=tiny_model, lora_r=r, lora_alpha=2 * r))
        model.save_pretrained(tmp_path / f"v{v}")
        common.publish_adapter(bucket, tmp_path / f"v{v}", v, v, tiny_model)
        assert proxy.http.post("/v1/adapters", json={"version": v, "step": v, "published_at": time.time()}).is_success

    publish(1, r=4)
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token,
           "SPOOL_DIR": str(tmp_path / "spool"), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--model", tiny_model, "--group-size", "4",
                               "--prompts-per-round", "1", "--max-new-tokens", "4", "--worker-id", "w1",
                               "--poll-s", "1"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    rounds = lambda: re.findall(r"round \d+ v(\d+):", log.read_text())  # noqa: E731
    try:
        t0 = time.time()
        while "1" not in rounds():
            assert time.time() - t0 < 180 and worker.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        publish(2, r=8)
        while "version 2" not in log.read_text() or len(rounds()) < rounds().index("1") + 4:
            assert time.time() - t0 < 240 and worker.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert worker.poll() is None, log.read_text()[-3000:]
    finally:
        stop(worker)
    text = log.read_text()
    assert re.search(r"refused version 2, keeping version 1: .*rank 8.*rank 4", text), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    after = rounds()[rounds().index("1"):]
    assert len(after) >= 4 and set(after) == {"1"}  # it kept generating, with v1 only
