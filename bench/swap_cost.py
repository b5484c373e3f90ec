"""What a mid-round adapter swap costs the hf engine (docs/engines.md, "Mid-round swaps"): one round of the
local run's shape (8 addition prompts x G 8, 24 new tokens, SmolLM2-135M, float32, one thread) sampled
without a swap and with a swap at token i, the same seed each time. At a swap hf_engine.sample recomputes the
KV cache of the completions still running under the new weights (finished ones leave the batch), so the cost
grows with how far into the round the swap comes and with how many completions still run. A swap callback
also makes the prefill go in chunks of hf_engine.PREFILL_CHUNK prompt tokens (swap(0) asked between them):
`never` times that with no swap, `0` a swap after the prefill's first chunk (the prefill starts again).

    .venv/bin/python bench/swap_cost.py                       # none, never, 0, 6, 12, 18; median of 3 rounds each
    .venv/bin/python bench/swap_cost.py --at 3 20 --repeats 5

Prints one line per setting (median round seconds, its ratio to no swap, completions still running at the
swap) and writes them as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import train  # noqa: E402
from hf_engine import sample, swap_in  # noqa: E402
from models import encode_prompt, load_base, local_smollm2  # noqa: E402
from tasks import load_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--at", type=int, nargs="+", default=[0, 6, 12, 18],
                    help="token indices to swap at (0: after the prefill's first chunk)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/swap_cost.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = local_smollm2()
    lora, _ = train.build_model(train.Args(model=model_dir))
    d = tempfile.mkdtemp(prefix="swap-cost-")
    lora.save_pretrained(d)
    new = {"version": 1, "dir": d, "tensors": load_file(os.path.join(d, "adapter_model.safetensors")), "meta": {}}
    base, tok = load_base(model_dir)
    model = swap_in(base, new)
    task = load_task("addition")
    prompts = [encode_prompt(tok, task.prompts[i]) for i in range(a.prompts)]
    eos = {tok.eos_token_id}

    def one_round(at: int | str | None, seed: int) -> tuple[float, int]:
        running = []

        def swap(i: int) -> bool:  # at "never": asked, never swaps (the chunked prefill alone)
            if i != at or running:
                return False
            swap_in(model, new)  # the same tensors again: the copy and the cache rebuild are what is timed
            running.append(i)
            return True
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = sample(model, prompts, a.group, a.new_tokens, 1.0, eos, tok.pad_token_id, swap=None if at is None else swap)
        dt = time.perf_counter() - t0
        return dt, sum(len(ids) > at for ids, _, _ in out) if running else 0

    rows = []
    for at in [None, "never", *a.at]:
        runs = [one_round(at, seed) for seed in range(a.repeats)]
        rows.append({"swap_at": at, "round_s": round(statistics.median(dt for dt, _ in runs), 3),
                     "running_at_swap": statistics.median(n for _, n in runs)})
    base_s = rows[0]["round_s"]
    for r in rows:
        r["ratio"] = round(r["round_s"] / base_s, 3)
        print(f"swap at {str(r['swap_at']):>4}: round {r['round_s']:.2f} s ({r['ratio']:.2f}x), "
              f"{r['running_at_swap']} of {a.prompts * a.group} completions still running at the swap")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
