"""rollout.py as a lying participant would run it: the real worker (its engine, episodes, leases, spool), but every
group it sends claims reward 1.0 for every completion, whatever the task scored (the inflated-reward lie of
tests/support/liar.py, here on any task, environments included). Used by bench/participants_run.py; the trainer's
audit re-scores each group (`reward`, docs/trust.md#environments) and the proxy quarantines the sender.

    PROXY_URL=... PROXY_TOKEN=<a participant's worker token> .venv/bin/python bench/lying_rollout.py --task calculator
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout  # noqa: E402 - puts the lib/ folders on sys.path (common)

honest_record = rollout.group_record


def inflated_record(*a, **k) -> dict:
    g = honest_record(*a, **k)
    for c in g["completions"]:
        c["reward"] = 1.0  # the lie: what the task scored is replaced by the best reward
    return g


rollout.group_record = inflated_record

if __name__ == "__main__":  # rollout.py's own __main__, with the lie in place
    import atexit
    import logging
    import os

    import tyro
    from common import script_args
    rollout.main(tyro.cli(rollout.Args, args=script_args()))
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
