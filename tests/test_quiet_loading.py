"""A run that never asked for 4-bit never touches bitsandbytes, and loading the models says no deprecation.

peft imports bitsandbytes whenever it is installed (at `import peft`, and again each time its LoRA dispatcher
wraps a layer); on a CPU with AVX512-BF16 that import tries to fetch a kernel from the Hub ("Failed to load
CPU gemm_4bit_forward from kernels-community"), and torch warns about its jit. So the trainer's and the
worker's model loading run here in a fresh process, with every warning turned into a record (category, the
file it is attributed to, the project frames on the stack when it was raised): bitsandbytes must not be in
sys.modules afterwards, no FutureWarning or DeprecationWarning may come from the project's own files, and
none may be raised while the project loads its models."""
import json
import subprocess
import sys

from conftest import ROOT

CHILD = r"""
import json, os, sys, traceback, warnings
root, tiny, adapters = sys.argv[1:4]
sys.path.insert(0, root)
import common  # as every script: it puts the lib/ folders on sys.path
REAL = os.path.realpath(root)

def ours(path):
    path = os.path.realpath(path)
    return path.startswith(REAL + os.sep) and "site-packages" not in path and "/.venv" not in path

seen, phase = [], "import"

def record(message, category, filename, lineno, file=None, line=None):
    seen.append({"phase": phase, "category": category.__name__, "file": filename, "line": lineno,
                 "ours": ours(filename), "message": str(message)[:300],
                 "callers": [f"{os.path.relpath(f.filename, root)}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                             if ours(f.filename)]})

warnings.showwarning = record
warnings.simplefilter("always")
import hf_engine, rollout, train
from safetensors.torch import load_file
phase = "load"
# the trainer's model (train.build_model: base, then LoRA through peft), its adapter saved as a version
model, _ = train.build_model(train.Args(model=tiny))
model.save_pretrained(adapters)
# the worker's hf backend: the base, the first version wrapped by peft, the next one copied in place
engine = hf_engine.HFSampler(tiny)
new = {"version": 1, "dir": adapters, "tensors": load_file(os.path.join(adapters, "adapter_model.safetensors"))}
engine.swap_in(new)
engine.swap_in({**new, "version": 2})
print(json.dumps({"bitsandbytes": "bitsandbytes" in sys.modules, "warnings": seen}))
"""


def test_model_loading_imports_no_bitsandbytes_and_warns_no_deprecation(tiny_model, tmp_path):
    p = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), tiny_model, str(tmp_path / "v1")],
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    deprecations = [w for w in got["warnings"] if w["category"] in ("FutureWarning", "DeprecationWarning")]
    assert not [w for w in deprecations if w["ours"]], json.dumps(deprecations, indent=1)
    assert not got["bitsandbytes"], "bitsandbytes was imported by a run that did not ask for 4-bit"
    assert not [w for w in deprecations if w["phase"] == "load"], json.dumps(deprecations, indent=1)
