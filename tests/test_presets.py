"""A run's configuration in one place (lib/jobs/presets.py): the scripts' defaults are the `local` preset, every
preset names options the scripts have, and what the launchers print and start is the documented preset."""
import re
import shlex
import subprocess

import pytest
import tyro

import launch_hf
import presets
from conftest import ROOT

ROLES = ("proxy", "train", "rollout")


def script_args(role: str):
    """The role's Args class (proxy.py, train.py, rollout.py), imported as the tests import scripts."""
    import proxy
    import rollout
    import train
    return {"proxy": proxy.Args, "train": train.Args, "rollout": rollout.Args}[role]


def parse(role: str, argv: list[str]):
    """What the role's own command line parser makes of argv: the settings the script runs with."""
    return tyro.cli(script_args(role), args=argv)


@pytest.mark.parametrize("role", ROLES)
def test_the_scripts_defaults_are_the_local_preset(role):
    """A script started by hand runs as the local run measured: its defaults are the `local` preset's values."""
    defaults = script_args(role)()
    local = presets.PRESETS["local"].options(role)
    assert set(local) == set(presets.RUN_SHAPING[role])
    assert {k: getattr(defaults, k) for k in local} == local


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_names_options_the_scripts_have(name):
    p = presets.PRESETS[name]
    for role in ROLES:
        got = parse(role, presets.flags(p.options(role)))  # an unknown option or a bad value: SystemExit
        assert {k: getattr(got, k) for k in p.options(role)} == p.options(role)
    assert p.version >= 1 and p.label == f"{name}@{p.version}"


def documented_preset() -> dict[tuple[str, str], str]:
    """docs/jobs.md's table of the Jobs preset: (role, option) -> value as written."""
    text = (ROOT / "docs" / "jobs.md").read_text()
    section = text.split("## The Jobs preset", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (proxy|train|rollout) \| `--([a-z-]+)` \| ([^|]+?) \|", section, re.M)
    assert rows, "docs/jobs.md has no table of the Jobs preset"
    return {(role, opt.replace("-", "_")): value.strip() for role, opt, value in rows}


def script_argv(line: str) -> list[str]:
    """The script's own arguments in a printed `hf jobs uv run ... -- SCRIPT FILES... ARGS` line."""
    words = shlex.split(line)
    rest = words[words.index("--") + 2:]
    while rest and rest[0].endswith(".py"):
        rest = rest[1:]
    return rest


def test_the_dry_run_prints_the_documented_jobs_preset_with_pacing_on(tmp_path):
    """bash launch_jobs.sh --dry-run --run my-run: the proxy's and the trainer's commands, read back by the scripts'
    own parsers, carry every setting docs/jobs.md gives the Jobs preset, pacing included."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(["bash", str(ROOT / "launch_jobs.sh"), "--dry-run", "--run", "my-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = {role: next(ln for ln in p.stdout.splitlines() if ln.startswith("hf jobs uv run")
                        and f"--label role={role}" in ln) for role in ("proxy", "trainer")}
    settings = {"proxy": parse("proxy", script_argv(lines["proxy"])),
                "train": parse("train", script_argv(lines["trainer"]))}
    assert settings["proxy"].pace is True
    documented = documented_preset()
    assert {role for role, _ in documented} >= {"proxy", "train"}
    for (role, option), value in documented.items():
        if role in settings:
            got = getattr(settings[role], option)
            want = {"on": True, "off": False}.get(value, value)
            assert (got == want if isinstance(got, bool) else str(got) == str(want)
                    or float(got) == float(want)), (role, option, got, value)
    assert "# preset jobs@1" in p.stdout


def test_the_local_launcher_takes_its_settings_from_the_preset_and_the_command_line_wins():
    """What `bash launch_jobs.sh --local` starts (launch_hf.py --local-plan): the preset's options, then the
    launcher's own (--steps) and the person's --train-arg, which win."""
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "launch_hf.py", "--local-plan", "--steps", "7",
                          "--train-arg=--loss", "--train-arg=ppo"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    plan = dict(re.findall(r"^([A-Z_]+)=(.*)$", out.stdout, re.M))
    assert plan["RUN_PRESET"] == "local@1" and plan["WORKERS"] == "1"
    argv = lambda name: shlex.split(plan[name].strip("()"))  # noqa: E731
    train = parse("train", argv("TRAIN_ARGS"))
    assert (train.max_steps, train.loss, train.task) == (7, "ppo", "addition")
    proxy = parse("proxy", argv("PROXY_ARGS"))
    assert proxy.pace is True and proxy.max_staleness == 1
    assert parse("rollout", argv("ROLLOUT_ARGS")).max_new_tokens == 24


def test_the_proxy_takes_the_temperature_the_workers_are_started_with():
    """The claimed temperature weighs a group's gradient, so the proxy takes only the run's (docs/trust.md): its default
    is the workers' default, and the local launcher passes it the temperature it starts the workers with, the
    person's --rollout-arg included."""
    import proxy
    import rollout
    assert proxy.Args().temperatures == (rollout.Args().temperature,)

    def plan(*extra: str) -> dict:
        out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "launch_hf.py", "--local-plan", *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got = dict(re.findall(r"^([A-Z_]+)=(.*)$", out.stdout, re.M))
        return {r: parse(r, shlex.split(got[k].strip("()"))) for r, k in (("proxy", "PROXY_ARGS"), ("rollout", "ROLLOUT_ARGS"))}
    for extra, want in [((), 1.0), (("--rollout-arg=--temperature", "--rollout-arg=0.7"), 0.7),
                        (("--rollout-arg=--temperature=0.5",), 0.5)]:
        got = plan(*extra)
        assert got["rollout"].temperature == want and got["proxy"].temperatures == (want,), (extra, got)


def test_an_unknown_preset_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit, match="--preset 'nope': one of local, local-calculator, jobs"):
        launch_hf.main(["--dry-run", "--preset", "nope"])


def test_the_local_launcher_gives_each_task_kind_its_token_budget_and_the_command_line_wins():
    """--max-new-tokens follows the task's kind (tasks.token_budget), not the preset's task: a reasoning-gym run on the
    addition preset gets 64 tokens, not addition's 24, which cut its answers before they were given; a
    --rollout-arg=--max-new-tokens wins."""
    def rollout_args(*extra: str):
        out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "launch_hf.py", "--local-plan", *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        plan = dict(re.findall(r"^([A-Z_]+)=(.*)$", out.stdout, re.M))
        return parse("rollout", shlex.split(plan["ROLLOUT_ARGS"].strip("()")))
    assert rollout_args("--task", "reasoning-gym:chain_sum").max_new_tokens == 64
    assert rollout_args("--task", "gsm8k").max_new_tokens == 512
    assert rollout_args("--task", "calculator", "--rollout-arg=--max-new-tokens", "--rollout-arg=40").max_new_tokens == 40
