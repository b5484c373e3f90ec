"""The layout counts of issue 42, measured on any commits: each commit's tree is extracted (`git archive COMMIT |
tar -x`) into a temporary folder and read there, so the working tree is never touched and nothing is written.

    .venv/bin/python bench/code_counts.py ca615d1 HEAD          # a table (metric, one column per commit), then listings
    .venv/bin/python bench/code_counts.py HEAD --no-listings    # the table alone

What is measured is the *shipped* code: the top-level scripts (proxy.py, rollout.py, train.py, ...), common.py and
lib/**/*.py. tests/ and bench/ are left out of every count, except as places that may *reference* a function (dead
functions below). Each metric, and what its heuristic misses:

- long functions: every def (functions, methods, nested defs) whose end_lineno - lineno + 1 exceeds 100, decorators
  not counted.
- long files: shipped files of more than 500 lines (physical lines, blank lines and docstrings included).
- lines each job ships: per role script present (proxy.py, rollout.py, train.py, launch_hf.py: the supervisor job,
  evaluate.py), the script plus the closure of the repository modules it imports, directly or through one another,
  lazy imports inside functions included: every `import m` / `from m import x` (not relative) whose first component
  names a module of the tree, modules found by stem among *.py and lib/*/*.py (lib/jobs/hf_jobs.py's shipped()
  does the same at HEAD). Physical lines of all those files.
- dead functions: module-level functions and methods of module-level classes, in shipped code, whose name occurs
  nowhere in the project's Python (shipped, tests/ and bench/, this script left out) as a Name, an Attribute, an
  imported name, or an identifier inside a string that is not a docstring (getattr(x, "name"), "proxy:app").
  Excluded: __dunder__ methods; defs under a registering decorator, i.e. any but property/staticmethod/
  classmethod/setter, functools' cache/lru_cache/cached_property/wraps, contextlib's contextmanager, abc's
  abstractmethod and torch's no_grad/inference_mode (FastAPI routes, pytest fixtures, pydantic validators are
  called by their library); methods of a class with a base outside the project (a library hook such as
  Thread.run or a verifiers renderer's bridge_to_next_turn is called by the library), unless the base is object,
  an exception, NamedTuple, Protocol, an Enum, TypedDict or pydantic's BaseModel. Misses: a dead function whose
  name is also used elsewhere (a dead `get` hides behind every `.get`), one only called by itself, a dead method
  of a library's subclass.
- copies of each rule: lines of shipped code (comments and docstrings blanked first, so only code matches) that
  implement one of the four rules the issue names; the regexes are RULES below, one per rule, plus the staleness
  rule's literal default (an option's default, an attribute's start value, a .get fallback: not a preset's
  setting, not a lower bound) and the zero-std rule's condition for skipping (--skip-zero-std with beta 0). Each
  hit is printed as file:line so a reader can check it. A call of the rule's one home (too_stale(...),
  sampled_mask(...), zero_std(...), computes_bf16(...)) is not a copy and does not match. Misses: a copy written
  another way (a staleness test spelt `version + max_staleness < latest`, an absent mask handled with
  `if "mask" in c`).
- places reading old formats: lines of shipped code, comments included (that is where such a branch says what
  it reads), matching OLD_FORMATS below: the words a branch for an earlier commit's records or peers uses
  ("legacy", "an older proxy.py", "journaled before 2026-12", "unpaced, as before", the 422 + "wait_s" sniff).
  Counted as lines and as places (distinct enclosing functions, or the module level). Misses: a branch for an
  old format that no comment names (a bare `.get("key", default)` for a field older writers left out). Not
  counted: the explicit protocol check that replaced them (common.check_protocol: it refuses an older clone, it
  reads nothing of it), and sentences that only narrate history ("stays the line it was before episodes").
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LONG_FUNCTION, LONG_FILE = 100, 500
ROLES = {"proxy": "proxy.py", "rollout": "rollout.py", "trainer": "train.py", "supervisor": "launch_hf.py",
         "evaluate": "evaluate.py"}

# each regex runs on one line of shipped code with its comments and docstrings blanked
RULES = {
    # latest - version > max_staleness, or version < latest - max_staleness; and a literal default of it
    "staleness rule": re.compile(r"[\w.\])]\s*-\s*[\w.\[\]()]+\s*>\s*[\w.]*max_staleness\b"
                                 r"|<\s*[\w.()]+\s*-\s*[\w.]*max_staleness\b"),
    # what applies when nothing sets it: an option's default or an attribute's start (max_staleness: int = 3,
    # MAX_STALENESS = 1) or a .get's fallback; a preset's {"max_staleness": 2} is a setting, not counted
    "staleness default (a literal)": re.compile(r"max_staleness\s*(?::\s*int\s*)?=\s*\d+\s*(?:$|[,)])"
                                                r"|\.get\(\s*[\"']max_staleness[\"']\s*,\s*\d+\s*\)", re.IGNORECASE),
    # a completion's absent mask means every token was sampled (mask 1)
    "sampled-token rule": re.compile(r"\.get\(\s*[\"']mask[\"']\s*\)|\bmask\s+or\s+\[1\]"),
    # a group whose rewards are all equal (zero std) has no signal
    "zero-std rule": re.compile(r"\bmax\([^()]*\)\s*==\s*min\(|\.amax\([^()]*\)\s*==\s*[\w.]*\.amin\("
                                r"|\.std\([^()]*\)\s*==\s*0"),
    # ... and when such a group is skipped: --skip-zero-std with beta 0 (a KL term still has a gradient)
    "zero-std skip condition": re.compile(r"skip_zero_std\b.*\bbeta\b.*==\s*0\b"),
    # a GPU computes in bf16: compute capability compared, or torch's is_bf16_supported()
    "bf16 rule": re.compile(r"capability[\w)\]\[:]*\s*>=\s*|get_device_capability\(\)\s*(?:\[0\])?\s*>="
                            r"|is_bf16_supported\(\)"),
}
OLD_FORMATS = re.compile(
    r"\blegacy|\ban older (?:proxy|rollout|train|trainer|worker|journal|snapshot|checkpoint)\b|\bolder \w+\.py"
    r"|\bolder than pacing|earlier commits?\b|\bold (?:journal|snapshot|format|record)s?\b|back-?compat"
    r"|\b(?:journaled|written|from) before 20\d\d|\bwritten before the (?:record|config)\b"
    r"|\b(?:unpaced|unrecorded|prompts),? as before\b|status\s*==\s*422\s+and\s+[\"']wait_s",
    re.IGNORECASE)
WRAPPERS = {"property", "staticmethod", "classmethod", "setter", "cache", "lru_cache", "cached_property", "wraps",
            "contextmanager", "asynccontextmanager", "abstractmethod", "no_grad", "inference_mode"}
VALUE_BASES = {"object", "Exception", "RuntimeError", "ValueError", "NamedTuple", "Protocol", "Enum", "IntEnum",
               "StrEnum", "BaseModel", "TypedDict"}
IDENT = re.compile(r"[A-Za-z_]\w*")


def extract(commit: str, into: Path) -> str:
    """Unpack `commit`'s tree into `into`; returns its short hash. Exits naming the commit if git does not know it."""
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", "--verify", "-q", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        sys.exit(f"code_counts: {commit!r} is not a commit of {REPO}")
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", found.stdout.strip()], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait():
        sys.exit(f"code_counts: git archive {commit} failed")
    return found.stdout.strip()


def shipped_files(root: Path) -> list[Path]:
    """The shipped Python of a tree: top-level *.py (scripts, common.py) and lib/**/*.py."""
    return sorted([*root.glob("*.py"), *root.glob("lib/**/*.py")])


def all_python(root: Path) -> list[Path]:
    """Every .py of the tree but this script, whose regexes name the rules' functions."""
    return sorted(p for p in root.rglob("*.py") if p.relative_to(root) != Path("bench/code_counts.py"))


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def qualified_defs(tree: ast.AST, prefix: str = ""):
    """(qualified name, def node) of every def under `tree`, nested ones as outer.inner, methods as Class.method."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from qualified_defs(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from qualified_defs(node, f"{prefix}{node.name}.")
        else:
            yield from qualified_defs(node, prefix)


def long_functions(root: Path, files: list[Path]) -> list[str]:
    out = []
    for f in files:
        for name, node in qualified_defs(ast.parse(f.read_text())):
            if (n := node.end_lineno - node.lineno + 1) > LONG_FUNCTION:
                out.append(f"{f.relative_to(root)}:{node.lineno} {name} ({n} lines)")
    return out


def long_files(root: Path, files: list[Path]) -> list[str]:
    return [f"{f.relative_to(root)} ({n} lines)" for f in files if (n := line_count(f)) > LONG_FILE]


def imported_modules(tree: ast.AST) -> set[str]:
    """First components of every absolute import anywhere in `tree` (function bodies included)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def job_closure(root: Path, script: str) -> list[Path]:
    """The script and every module of the tree it imports, directly or through one another."""
    ours = {p.stem: p for p in [*root.glob("*.py"), *root.glob("lib/*/*.py")]}
    found, todo = {Path(script).stem}, [Path(script).stem]
    while todo:
        for m in imported_modules(ast.parse(ours[todo.pop()].read_text())) & set(ours) - found:
            found.add(m)
            todo.append(m)
    return sorted(ours[m] for m in found)


def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (or other bare string statements)."""
    return {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str)}


def referenced_names(files: list[Path]) -> set[str]:
    """Every name a file uses: Name ids, Attribute attrs, imported names, identifiers in non-docstring strings."""
    names = set()
    for f in files:
        tree = ast.parse(f.read_text())
        docs = docstring_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {a.name.split(".")[-1] for a in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                names |= set(IDENT.findall(node.value))
    return names


def decorator_name(d: ast.expr) -> str:
    d = d.func if isinstance(d, ast.Call) else d
    return d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else "?"


def base_name(b: ast.expr) -> str:
    b = b.value if isinstance(b, ast.Subscript) else b
    return b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else "?"


def dead_candidates(tree: ast.Module, project_classes: set[str]):
    """(qualified name, def) of the module-level functions and methods a dead-code search may judge."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            if any(base_name(b) not in project_classes | VALUE_BASES for b in node.bases):
                continue  # a library's subclass: its methods may be hooks the library calls
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{m.name}", m


def dead_functions(root: Path, files: list[Path]) -> list[str]:
    used = referenced_names(all_python(root))
    trees = {f: ast.parse(f.read_text()) for f in files}
    classes = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    out = []
    for f, tree in trees.items():
        for name, node in dead_candidates(tree, classes):
            short = node.name
            if short.startswith("__") and short.endswith("__"):
                continue
            if any(decorator_name(d) not in WRAPPERS for d in node.decorator_list):
                continue
            if short not in used:
                out.append(f"{f.relative_to(root)}:{node.lineno} {name}")
    return out


def code_lines(text: str) -> list[str]:
    """The file's lines with comments and docstrings blanked (other strings kept: .get("mask") is code)."""
    lines = text.splitlines()
    docs = {(n.lineno, n.end_lineno) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Expr)
            and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    for start, end in docs:
        for i in range(start - 1, end):
            lines[i] = ""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return lines


def rule_hits(root: Path, files: list[Path]) -> dict[str, list[str]]:
    hits = {rule: [] for rule in RULES}
    for f in files:
        for i, line in enumerate(code_lines(f.read_text()), 1):
            for rule, rx in RULES.items():
                if rx.search(line):
                    hits[rule].append(f"{f.relative_to(root)}:{i}  {line.strip()[:110]}")
    return hits


def enclosing(tree: ast.Module, line: int) -> str:
    """The innermost def around `line`, or "<module>"."""
    best = "<module>"
    for name, node in qualified_defs(tree):
        if node.lineno <= line <= node.end_lineno:
            best = name
    return best


def old_format_hits(root: Path, files: list[Path]) -> tuple[list[str], int]:
    """Lines matching OLD_FORMATS (comments and strings included), and how many distinct places hold them."""
    lines, places = [], set()
    for f in files:
        text = f.read_text()
        tree = ast.parse(text)
        for i, line in enumerate(text.splitlines(), 1):
            if OLD_FORMATS.search(line):
                where = enclosing(tree, i)
                places.add((f, where))
                lines.append(f"{f.relative_to(root)}:{i} [{where}]  {line.strip()[:100]}")
    return lines, len(places)


def measure(root: Path) -> dict:
    files = shipped_files(root)
    jobs = {role: job_closure(root, script) for role, script in ROLES.items() if (root / script).exists()}
    old, places = old_format_hits(root, files)
    return {"files": files, "long_functions": long_functions(root, files), "long_files": long_files(root, files),
            "jobs": {role: (sum(map(line_count, fs)), [str(f.relative_to(root)) for f in fs])
                     for role, fs in jobs.items()},
            "dead": dead_functions(root, files), "rules": rule_hits(root, files), "old_formats": old,
            "old_places": places}


def table(results: dict[str, dict]) -> list[tuple[str, ...]]:
    cols = list(results.values())
    rows = [("shipped .py files", *[str(len(r["files"])) for r in cols]),
            ("shipped lines", *[str(sum(map(line_count, r["files"]))) for r in cols]),
            (f"functions over {LONG_FUNCTION} lines", *[str(len(r["long_functions"])) for r in cols]),
            (f"files over {LONG_FILE} lines", *[str(len(r["long_files"])) for r in cols])]
    rows += [(f"copies: {rule}", *[str(len(r["rules"][rule])) for r in cols]) for rule in RULES]
    roles = [role for role in ROLES if any(role in r["jobs"] for r in cols)]
    rows += [(f"lines shipped: {role} ({ROLES[role]})", *[str(r["jobs"].get(role, ("-",))[0]) for r in cols])
             for role in roles]
    rows += [("dead functions", *[str(len(r["dead"])) for r in cols]),
             ("old-format lines", *[str(len(r["old_formats"])) for r in cols]),
             ("old-format places (functions)", *[str(r["old_places"]) for r in cols])]
    return rows


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def print_listings(name: str, r: dict) -> None:
    print(f"\n=== {name}")
    sections = [("functions over 100 lines", r["long_functions"]), ("files over 500 lines", r["long_files"]),
                *[(f"copies: {rule}", hits) for rule, hits in r["rules"].items()],
                ("dead functions", r["dead"]), ("old-format lines [enclosing function]", r["old_formats"])]
    for title, items in sections:
        print(f"-- {title}: {len(items)}")
        for it in items:
            print(f"   {it}")
    for role, (n, fs) in r["jobs"].items():
        print(f"-- {role} ships {n} lines: {' '.join(fs)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commits", nargs="+", help="commits to measure (hashes, HEAD, branch names)")
    p.add_argument("--no-listings", action="store_true", help="print the table only")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="code_counts_") as tmp:
        for i, commit in enumerate(args.commits):
            root = Path(tmp) / str(i)
            root.mkdir()
            short = extract(commit, root)
            results[short] = measure(root)
            if not args.no_listings:
                print_listings(f"{commit} ({short})", results[short])
        print()
        print_table(table(results), ("metric", *results))


if __name__ == "__main__":
    main()
