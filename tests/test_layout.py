"""The tree shows the architecture (docs/DESIGN.md, section 2): at the top only the scripts a user runs and
common.py; every module they import in lib/<who uses it>/, with a unique name (in a job every file lands
flat beside its script); imports point one way (scripts -> lib/<role> -> lib/shared -> common), with no
circle. Read from the code."""
import ast
import subprocess

import hf_jobs
from conftest import ROOT

SCRIPTS = {"proxy", "rollout", "train", "evaluate", "report", "launch_hf"}
RANK = {"common": 0, "shared": 1, "proxy": 2, "rollout": 2, "train": 2, "jobs": 2}  # lib/<folder> -> its layer


def ours(path) -> set[str]:
    """The modules of ours that `path` imports (at module level or lazily inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names & set(hf_jobs.modules()) - {path.stem}


def where(stem: str) -> str:
    """'script', 'common', or the lib folder a module lives in."""
    path = hf_jobs.modules()[stem]
    return "script" if stem in SCRIPTS else "common" if stem == "common" else path.parent.name


def test_the_top_level_holds_the_scripts_and_common_only():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {f for f in tracked if "/" not in f}
    assert {f[:-3] for f in top if f.endswith(".py")} == SCRIPTS | {"common"}, sorted(top)
    assert {"launch_jobs.sh", "README.md", "requirements.txt"} <= top
    lib = [f for f in tracked if f.startswith("lib/") and f.endswith(".py")]
    assert all(f.count("/") == 2 for f in lib), [f for f in lib if f.count("/") != 2]
    stems = [f.rsplit("/", 1)[1] for f in lib] + [f for f in top if f.endswith(".py")]
    assert len(stems) == len(set(stems)), sorted(s for s in stems if stems.count(s) > 1)


def test_imports_point_one_way():
    mods = hf_jobs.modules()
    assert set(RANK) - {"common"} == {where(m) for m in mods if where(m) not in ("script", "common")}
    upward = []
    for stem, path in mods.items():
        here = where(stem)
        for dep in ours(path):
            there = where(dep)
            if there == "script":
                upward.append(f"{stem} imports the script {dep}")
            elif here == "common":
                upward.append(f"common imports {dep}")
            elif here != "script" and (RANK[there] > RANK[here] or RANK[there] == RANK[here] == 2 and there != here):
                upward.append(f"lib/{here}/{stem} imports lib/{there}/{dep}")
    assert not upward, upward


def test_no_import_circles():
    graph = {stem: ours(path) for stem, path in hf_jobs.modules().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, f"import circle: {' -> '.join(path + [m, d])}"
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
