"""rollout.py as a lying participant would run it: the real worker (its engine, episodes, leases, spool), but every
group it sends carries one lie (--lie, default rewards):

    rewards      every completion claims reward 1.0, whatever the task scored (the inflated-reward lie of
                 tests/support/liar.py, here on any task, environments included): the trainer re-scores it (`reward`)
    logprobs     every sampled token's behaviour logprob is claimed at half its value (each token claimed more likely
                 than it was sampled, what inflates an importance ratio); rewards and tokens true: the trainer's
                 recompute (`--audit.logprob-share`) or the step's own forward (`logprobs`) has to find it
    temperature  it samples at half the temperature it claims (the run's: --claimed-temperature, default 1.0), its
                 logprobs the true ones of what it sampled: at the claimed temperature they are wrong (`logprobs`)

Used by bench/participants_run.py; the proxy quarantines the sender at its --quarantine-after.

    PROXY_URL=... PROXY_TOKEN=<a participant's worker token> .venv/bin/python bench/lying_rollout.py --task calculator
    PROXY_URL=... PROXY_TOKEN=... .venv/bin/python bench/lying_rollout.py --lie logprobs --task addition
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout  # noqa: E402 - puts the lib/ folders on sys.path (common)
from common import sampled_mask  # noqa: E402

LIES = ("rewards", "logprobs", "temperature")


class Lying:
    """The worker's group_record with `lie` in place (module docstring)."""

    def __init__(self, honest_record, lie: str, claimed_temperature: float):
        self.honest_record, self.lie, self.claimed = honest_record, lie, claimed_temperature

    def __call__(self, *a, **k) -> dict:
        g = self.honest_record(*a, **k)
        for c in g["completions"]:
            if self.lie == "rewards":
                c["reward"] = 1.0  # what the task scored is replaced by the best reward
            elif self.lie == "logprobs":
                c["logprobs"] = [lp / 2 if m else lp for lp, m in zip(c["logprobs"], sampled_mask(c))]
        if self.lie == "temperature":
            g["meta"]["temperature"] = self.claimed  # sampled at half of it (main)
        return g


def take(argv: list[str], flag: str, default: str) -> str:
    """The value of `flag` in argv, removed from it (rollout.py's own options are the rest)."""
    if flag not in argv:
        return default
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


if __name__ == "__main__":  # rollout.py's own __main__, with the lie in place
    import tyro
    from common import script_args
    argv = script_args()
    lie, claimed = take(argv, "--lie", "rewards"), float(take(argv, "--claimed-temperature", "1.0"))
    if lie not in LIES:
        raise SystemExit(f"--lie {lie}: one of {', '.join(LIES)}")
    args = tyro.cli(rollout.Args, args=argv)
    if lie == "temperature":
        from dataclasses import replace
        args = replace(args, temperature=claimed / 2)
    rollout.group_record = Lying(rollout.group_record, lie, claimed)
    rollout.main(args)
    rollout.leave()
