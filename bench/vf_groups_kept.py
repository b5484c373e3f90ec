"""The share of groups a multi-turn verifiers environment keeps: episodes run by verifiers' own loop through the
worker's loopback generate endpoint (lib/rollout/verifiers_env.py), in process, with the worker's hf engine on the
local SmolLM2-135M, rounds as rollout.py runs them. A group is kept when none of its episodes drifted (a later
call's prompt not extending what was sampled before it) or failed; also printed: the share of sampled turns whose
token ids are not their own text's tokenisation (what a renderer that re-renders the history from text turns into
drift). Runs in the envs venv:

    .venv-envs/bin/python bench/vf_groups_kept.py                                  # tests/support/vf_guess, 6 rounds
    .venv-envs/bin/python bench/vf_groups_kept.py --spec 'vf_guess?renderer=default'  # verifiers' own renderer

Prints one line per round and a last line with the totals.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))  # the test environments (vf_guess)
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path

import torch  # noqa: E402
import tyro  # noqa: E402

from hf_engine import HFSampler  # noqa: E402
from models import LOCAL_MODEL, model_path  # noqa: E402
from verifiers_env import VerifiersEnvironment  # noqa: E402


@dataclass
class Args:
    spec: str = "vf_guess"
    """the verifiers environment and its options, as after --task verifiers:"""
    rounds: int = 6
    prompts: int = 4
    """prompts per round"""
    first: int = 0
    """the first prompt index (round r runs the next --prompts after the previous round's)"""
    group_size: int = 4
    temperature: float = 0.7
    max_new_tokens: int = 6
    max_episode_tokens: int = 160
    seed: int = 0


def own_tokenisation(tok, ids: list[int]) -> bool:
    """Whether a sampled turn's ids are what its text tokenises to (the EOS it ended on aside)."""
    body = [t for t in ids if t != tok.eos_token_id]
    return tok.encode(tok.decode(body), add_special_tokens=False) == body


def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    engine = HFSampler(LOCAL_MODEL, "float32")
    env = VerifiersEnvironment(args.spec, model_path(LOCAL_MODEL), engine.generate_ids, 2048, args.temperature,
                               args.max_new_tokens, 0, args.max_episode_tokens)
    kept = groups = drifted = failed = turns = foreign = 0
    t0 = time.time()
    try:
        for r in range(args.rounds):
            idx = list(range(args.first + r * args.prompts, args.first + (r + 1) * args.prompts))
            _, eps = env.run(idx, args.group_size, 0)
            for j in range(len(idx)):
                g = eps[j * args.group_size:(j + 1) * args.group_size]
                groups += 1
                kept += not any(e.drift or e.failed for e in g)
            drifted += sum(e.drift is not None for e in eps)
            failed += sum(e.failed is not None for e in eps)
            for e in eps:
                runs, cur = [], []
                for t, m in zip(e.tokens, e.mask):
                    if m:
                        cur.append(t)
                    elif cur:
                        runs.append(cur)
                        cur = []
                runs += [cur] if cur else []
                turns += len(runs)
                foreign += sum(not own_tokenisation(engine.tok, run) for run in runs)
            print(f"round {r + 1}: groups kept {kept}/{groups}, episodes drifted {drifted}, failed {failed}, "
                  f"turns mean {sum(e.turns for e in eps) / len(eps):.2f}, {time.time() - t0:.0f} s", flush=True)
    finally:
        env.close()
    print(f"{args.spec}: groups kept {kept}/{groups} ({kept / max(1, groups):.2f}); episodes drifted {drifted}, failed "
          f"{failed} of {groups * args.group_size}; sampled turns not their text's own tokenisation {foreign}/{turns} "
          f"({foreign / max(1, turns):.3f}); {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(tyro.cli(Args))
