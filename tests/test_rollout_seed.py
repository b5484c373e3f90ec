"""`--seed` reproduces a worker: the seed a worker gives torch (and a vLLM engine or a server it starts) is
a function of --seed and --worker-id alone, the same in every process. Python salts str hashes per process
(PYTHONHASHSEED), so a seed taken from hash(worker_id) would differ at each start of the same worker.

The worker's own main() runs in fresh processes with different PYTHONHASHSEED values; torch.manual_seed
(the library below the worker's code) records the seed it is given and stops the process there."""
import json
import os
import subprocess
import sys

from conftest import ROOT

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import rollout

class Seeded(Exception):
    pass

def manual_seed(s):
    print(json.dumps({"seed": int(s)}), flush=True)
    raise Seeded

torch.manual_seed = manual_seed
try:
    rollout.main(rollout.Args(proxy_url="http://127.0.0.1:9", worker_id=sys.argv[2], seed=int(sys.argv[3]),
                              backend="hf"))
except Seeded:
    pass
"""


def worker_seed(worker_id: str, seed: int, hashseed: str) -> int:
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "OMP_NUM_THREADS": "1"}
    env.pop("BUCKET", None)
    p = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), worker_id, str(seed)], env=env, capture_output=True,
                       text=True, timeout=120)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert lines, p.stdout + p.stderr[-2000:]
    return lines[0]["seed"]


def test_the_same_seed_and_worker_id_give_the_same_seed_in_every_process():
    seeds = {h: worker_seed("my-run-w1", 3, h) for h in ("1", "2", "3")}
    assert len(set(seeds.values())) == 1, f"worker seed by PYTHONHASHSEED: {seeds}"
    # and it still tells workers (and --seed values) apart
    assert worker_seed("my-run-w2", 3, "1") != seeds["1"]
    assert worker_seed("my-run-w1", 4, "1") != seeds["1"]


def test_worker_seed_is_stable_across_versions():
    """The rule itself, pinned: a change would silently change what every documented --seed reproduces."""
    import rollout
    # --seed plus the first 4 bytes of sha256(worker id), mod 2^30 (so that a seed fits any engine's int)
    assert rollout.worker_seed(0, "my-run-w1") == 94690695 and rollout.worker_seed(0, "w1") == 549804303
    assert rollout.worker_seed(3, "my-run-w1") == 94690695 + 3
