"""The wheels bench/gpu_hf_check.sh carries to the GPU machine, and their install there.

That machine (nvidia-h200) has no network, runs its own Python 3.12 with torch 2.11+cu130,
transformers 5.17, peft and accelerate, and takes at most 64 MiB of files per command. The project's
trainer code needs a few pure-Python packages it lacks (bench/gpu_wheels.txt); they travel as wheels
and are installed into a separate folder put on PYTHONPATH, so the machine's own torch, transformers
and peft are the ones used, never replaced.

    python bench/gpu_wheels.py download [--dest wheels-gpu] [--rehearsal wheels-rehearsal]   # here, with PyPI
    python bench/gpu_wheels.py install --wheels wheels-gpu --target /tmp/site                 # there, offline
    PYTHONPATH=/tmp/site python bench/gpu_wheels.py verify --target /tmp/site                 # there: the stack check
    python bench/gpu_wheels.py size [--carry wheels-gpu]                                      # what a run would send

download: the list for CPython 3.12 manylinux x86_64 (pip download --no-deps --only-binary), the
bitsandbytes wheel cut to its CUDA 13.0 and CPU libraries, a check that every wheel's Requires-Dist
is met by the list itself or by the machine's package list (KINDS.md), and the size of what would
travel. With --rehearsal, also what the CPU rehearsal needs to install the same list with this
machine's Python (3.11): cp311 builds of the wheels that are not pure Python, and the machine's
transformers/huggingface_hub/tokenizers versions (the rehearsal runs the check on them).
install: one wheel per distribution that this interpreter can install (packaging.tags), skipping
those the interpreter already has at the same or a newer version (--all: install every one); refuses
a wheel of the machine's own stack (torch, transformers, peft, ...) unless --allow-protected.
verify: in the interpreter that will run the check (PYTHONPATH=target): the protected packages
import from outside the target, what the target holds imports from it, and train/hf_engine/models/memory
import; prints each package's version and where it came from; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIST = os.path.join(ROOT, "bench", "gpu_wheels.txt")
LIMIT = 64 * 1024 ** 2          # the device tool's limit on what travels with one command
MARGIN = 48 * 1024 ** 2         # what we allow ourselves: room for the repository to grow

# the machine's own stack: never carried, never shadowed (distribution names, normalized)
PROTECTED = {"torch", "transformers", "peft", "accelerate", "tokenizers", "safetensors", "huggingface-hub",
             "numpy", "triton", "torchvision", "torchaudio", "packaging", "pip", "setuptools"}
PROTECTED_PREFIXES = ("nvidia-", "cuda-")
PROTECTED_MODULES = ["torch", "transformers", "peft", "accelerate", "tokenizers", "safetensors",
                     "huggingface_hub", "numpy", "triton"]
# the machine's Python packages as KINDS.md lists them (image 'cuda', read 2026-11-17)
MACHINE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet
filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split())
# the machine's versions of the packages the check runs on (KINDS.md's pip list), for the rehearsal
MACHINE_STACK = ["transformers==5.17.0", "huggingface_hub==1.33.0", "tokenizers==0.23.2"]
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64",
                                                                                  "manylinux1_x86_64"]
BNB_KEEP = ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def protected(name: str) -> bool:
    n = norm(name)
    return n in PROTECTED or n.startswith(PROTECTED_PREFIXES)


def read_list(path: str = LIST) -> list[str]:
    return [ln.split("#")[0].strip() for ln in open(path) if ln.split("#")[0].strip()]


def pip_download(specs: list[str], dest: str, py: str | None, platforms: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", dest]
    if py:
        cmd += ["--python-version", py, "--implementation", "cp"]
    if platforms:
        for p in PLATFORMS:
            cmd += ["--platform", p]
    subprocess.run(cmd + specs, check=True)


def wheel_info(path: str):
    from packaging.utils import parse_wheel_filename
    return parse_wheel_filename(os.path.basename(path))


def slim_bitsandbytes(whl: str) -> str:
    """The bitsandbytes wheel with only BNB_KEEP's native libraries (RECORD rewritten to match);
    named with build tag 1cu130 so it is never mistaken for PyPI's file. Returns the new path."""
    name, ver, _, _ = wheel_info(whl)
    tail = os.path.basename(whl).split(f"-{ver}-", 1)[1]
    out = os.path.join(os.path.dirname(whl), f"bitsandbytes-{ver}-1cu130-{tail}")
    drop = re.compile(r"bitsandbytes/libbitsandbytes_.*\.so$")
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        kept = [i for i in zin.infolist() if not (drop.match(i.filename) and os.path.basename(i.filename) not in BNB_KEEP)]
        missing = [k for k in BNB_KEEP if not any(i.filename.endswith("/" + k) for i in kept)]
        if missing:
            raise SystemExit(f"{whl} has no {missing}: pick another bitsandbytes version")
        for i in kept:
            data = zin.read(i)
            if i.filename.endswith(".dist-info/RECORD"):
                names = {k.filename for k in kept}
                data = "".join(ln for ln in data.decode().splitlines(True) if ln.split(",")[0] in names
                               or ln.split(",")[0].endswith("RECORD")).encode()
            zout.writestr(i, data)
    os.remove(whl)
    return out


def requires(whl: str) -> list:
    from packaging.requirements import Requirement
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(ln.split(":", 1)[1].strip()) for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET_ENV)]


def check_closure(wheels: list[str]) -> list[str]:
    """Requirements of the carried wheels that neither the carried set nor the machine meets."""
    have = {norm(wheel_info(w)[0]): str(wheel_info(w)[1]) for w in wheels}
    bad = []
    for w in wheels:
        for r in requires(w):
            n = norm(r.name)
            if n in have:
                if not r.specifier.contains(have[n], prereleases=True):
                    bad.append(f"{os.path.basename(w)} needs {r}, carried {have[n]}")
            elif n not in MACHINE:
                bad.append(f"{os.path.basename(w)} needs {r}: neither carried nor on the machine")
    return bad


def travelling_bytes(carry: list[str]) -> tuple[int, int]:
    """(bytes of what the device tool sends besides carried paths, bytes of the carried paths)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    tree = sum(os.path.getsize(os.path.join(ROOT, f)) for f in files if f and os.path.isfile(os.path.join(ROOT, f)))
    carried = 0
    for c in carry:
        p = os.path.join(ROOT, c)
        for d, _, fs in os.walk(p):
            carried += sum(os.path.getsize(os.path.join(d, f)) for f in fs)
    return tree, carried


def cmd_download(a) -> None:
    dest = os.path.join(ROOT, a.dest)
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    specs = read_list()
    if bad := [s for s in specs if protected(re.split(r"[=<>!~ ]", s)[0])]:
        raise SystemExit(f"{LIST} lists the machine's own stack: {bad}")
    pip_download(specs, dest, "3.12", True)
    for w in os.listdir(dest):
        if norm(w.split("-")[0]) == "bitsandbytes":
            full = os.path.getsize(os.path.join(dest, w))
            slim = slim_bitsandbytes(os.path.join(dest, w))
            print(f"bitsandbytes: PyPI's wheel {full / 2**20:.1f} MiB, cut to {os.path.getsize(slim) / 2**20:.1f} MiB "
                  f"({', '.join(BNB_KEEP)})")
    wheels = sorted(os.path.join(dest, w) for w in os.listdir(dest))
    for w in wheels:
        print(f"  {os.path.getsize(w) / 2**20:6.2f} MiB  {os.path.basename(w)}")
    if bad := check_closure(wheels):
        raise SystemExit("unmet requirements:\n  " + "\n  ".join(bad))
    print(f"every Requires-Dist (for CPython 3.12, Linux x86_64) is met by {a.dest}/ or the machine's packages")
    if a.rehearsal:
        reh = os.path.join(ROOT, a.rehearsal)
        shutil.rmtree(reh, ignore_errors=True)
        binary = [f"{wheel_info(w)[0]}=={wheel_info(w)[1]}" for w in wheels
                  if not any(t.abi in ("none", "abi3") for t in wheel_info(w)[3])]
        os.makedirs(os.path.join(reh, "cp311"))
        os.makedirs(os.path.join(reh, "stack"))
        if binary:  # the same versions, built for this machine's Python
            pip_download(binary, os.path.join(reh, "cp311"), "3.11", True)
        pip_download(MACHINE_STACK, os.path.join(reh, "stack"), "3.11", True)
        print(f"rehearsal wheels in {a.rehearsal}/: cp311 builds of {binary or 'nothing'}; the machine's {MACHINE_STACK}")
    cmd_size(argparse.Namespace(carry=[a.dest]))


def cmd_size(a) -> None:
    tree, carried = travelling_bytes(a.carry)
    total = tree + carried
    print(f"a run sends {total / 2**20:.1f} MiB: the working tree {tree / 2**20:.1f} MiB + carried {a.carry} "
          f"{carried / 2**20:.1f} MiB (the tool's limit {LIMIT / 2**20:.0f} MiB; this check allows itself {MARGIN / 2**20:.0f})")
    if total > MARGIN:
        raise SystemExit("too large to carry")


def compatible(paths: list[str]) -> dict[str, str]:
    """name -> the first wheel (in the folders' order) this interpreter can install."""
    from packaging.tags import sys_tags
    ok = set(sys_tags())
    chosen: dict[str, str] = {}
    for p in paths:
        name, _, _, tags = wheel_info(p)
        if norm(name) not in chosen and tags & ok:
            chosen[norm(name)] = p
    return chosen


def cmd_install(a) -> None:
    from packaging.version import Version
    paths = [os.path.join(d, w) for d in a.wheels if os.path.isdir(d) for w in sorted(os.listdir(d)) if w.endswith(".whl")]
    if not paths:
        raise SystemExit(f"no wheels in {a.wheels}: run `python bench/gpu_wheels.py download` on a machine with PyPI")
    names = {norm(wheel_info(p)[0]) for p in paths}
    chosen = compatible(paths)
    if unusable := sorted(names - set(chosen)):
        raise SystemExit(f"no wheel in {a.wheels} for this Python ({sys.version.split()[0]}) for: {unusable}")
    todo, notes = [], []
    for n, p in sorted(chosen.items()):
        if protected(n) and not a.allow_protected:
            raise SystemExit(f"refusing {os.path.basename(p)}: {n} is the machine's own; a carried copy would shadow it")
        carried = wheel_info(p)[1]
        try:
            have = md.version(n)
        except md.PackageNotFoundError:
            have = None
        if have is not None and not a.all and Version(have) >= carried:
            notes.append(f"{n} {have} (this Python's; carried {carried} not installed)")
            continue
        todo.append(p)
        notes.append(f"{n} {carried} (carried{'; this Python has ' + have if have else ''})")
    os.makedirs(a.target, exist_ok=True)
    if todo:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", a.target, *todo],
                       check=True)
    print(f"installed into {a.target}: " + "; ".join(notes))


def target_modules(target: str) -> dict[str, str]:
    """import name -> distribution, for what the target folder holds."""
    out = {}
    for d in os.listdir(target):
        if not d.endswith(".dist-info"):
            continue
        dist = norm(d[: -len(".dist-info")].rsplit("-", 1)[0])
        tops = set()
        top = os.path.join(target, d, "top_level.txt")
        if os.path.isfile(top):
            tops = {t.strip() for t in open(top) if t.strip()}
        else:
            for ln in open(os.path.join(target, d, "RECORD")):
                first = ln.split(",")[0].split("/")[0]
                if not first.endswith((".dist-info", ".data")) and not first.startswith(".."):
                    tops.add(first[:-3] if first.endswith(".py") else first)
        for t in tops:
            out[t] = dist
    return out


def cmd_verify(a) -> None:
    target = os.path.realpath(a.target)
    under = lambda mod: os.path.realpath(getattr(mod, "__file__", "") or "").startswith(target + os.sep)  # noqa: E731
    fails, rows = [], []
    held = target_modules(target) if os.path.isdir(target) else {}
    for m in PROTECTED_MODULES:
        if os.path.exists(os.path.join(target, m)) or m in held:
            fails.append(f"{target} holds {m}: it would shadow the machine's")
    for m in PROTECTED_MODULES:
        try:
            mod = importlib.import_module(m)
        except Exception as e:  # triton is absent on CPU-only machines
            rows.append((m, "-", f"not importable ({type(e).__name__})"))
            if m in ("torch", "transformers", "peft"):
                fails.append(f"{m} does not import: {e}")
            continue
        if under(mod):
            fails.append(f"{m} imports from the carried folder {target}")
        rows.append((m, getattr(mod, "__version__", "?"), os.path.dirname(mod.__file__)))
    for m, dist in sorted(held.items()):
        try:
            mod = importlib.import_module(m)
        except Exception as e:
            fails.append(f"carried {m} ({dist}) does not import: {type(e).__name__}: {e}")
            continue
        if not under(mod):
            fails.append(f"carried {m} imports from {mod.__file__}, not from {target}")
        rows.append((m, md.version(dist), "carried: " + os.path.dirname(mod.__file__)))
    for m in ("boto3", "pydantic", "tenacity", "typing_extensions", "bitsandbytes"):
        if m not in held:  # the machine's own, or absent
            try:
                mod = importlib.import_module(m)
                rows.append((m, getattr(mod, "__version__", "?"), "the machine's: " + os.path.dirname(mod.__file__)))
            except Exception as e:
                rows.append((m, "-", f"not importable ({type(e).__name__}: {e})"[:120]))
                if m != "bitsandbytes":
                    fails.append(f"{m} does not import")
    sys.path.insert(0, ROOT)
    import common  # noqa: F401 - first of ours: puts the lib/ folders on sys.path
    for m in ("memory", "models", "hf_engine", "train"):
        try:
            importlib.import_module(m)
        except Exception as e:
            fails.append(f"project module {m} does not import: {type(e).__name__}: {e}")
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    for m, v, where in rows:
        print(f"  {m:18s} {v:22s} {where}")
    if fails:
        print("stack check FAILED:\n  " + "\n  ".join(fails), file=sys.stderr)
        sys.exit(1)
    print(f"stack check ok: the machine's torch/transformers/peft, the carried packages from {target}, "
          "the project's modules import")
    if a.json:
        json.dump({m: {"version": v, "from": w} for m, v, w in rows}, open(a.json, "w"), indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download")
    d.add_argument("--dest", default="wheels-gpu")
    d.add_argument("--rehearsal", default="wheels-rehearsal", help="'' to skip the rehearsal's wheels")
    i = sub.add_parser("install")
    i.add_argument("--wheels", nargs="+", required=True, help="folders, searched in order")
    i.add_argument("--target", required=True)
    i.add_argument("--all", action="store_true", help="install every wheel, even where this Python has the package")
    i.add_argument("--allow-protected", action="store_true", help="the rehearsal's emulation of the machine's stack")
    v = sub.add_parser("verify")
    v.add_argument("--target", required=True)
    v.add_argument("--json", help="also write the versions and locations here")
    s = sub.add_parser("size")
    s.add_argument("--carry", nargs="*", default=["wheels-gpu"])
    a = p.parse_args()
    {"download": cmd_download, "install": cmd_install, "verify": cmd_verify, "size": cmd_size}[a.cmd](a)


if __name__ == "__main__":
    main()
