"""Check the memory model (memory.py) against the trainer's measured peak memory on this CPU.

    .venv/bin/python bench/memory_check.py                                  # SmolLM2-135M, float32 and bf16, checkpointing off and on
    .venv/bin/python bench/memory_check.py --dtypes float32 --checkpointing off --new-tokens 64

Each configuration runs in a fresh process: it builds the trainer's model with train.build_model
(the real code path: --dtype, --gradient-checkpointing), then takes --steps trainer steps with
train.train_step on synthetic groups (P prompts of --prompt-tokens, G completions of --new-tokens
each, every completion at full length, rewards that differ within a group so nothing is skipped),
clipping and AdamW exactly as train.main does. Peak = the process's resident high-water mark
(VmHWM, /proc/self/status) minus its resident size after importing torch/transformers/peft and
before loading the model; the high-water mark is reset (/proc/self/clear_refs) once the model is
built, so loading's transients (dtype conversion) do not count, and glibc's mmap threshold is
fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the resident set at once
(by default glibc keeps up to 32 MB pieces in its heap, and RSS then overstates live memory by
~40% here).
The prediction is memory.trainer_memory for the same shapes with cuda=False (no CUDA overhead).
Exits 1 when a measurement is off the prediction by more than --tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path


def status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(cfg: dict) -> dict:
    """Runs in the measured process: build, reset the high-water mark, train, report."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline, as in train.py)
    import peft  # noqa: F401
    torch.set_num_threads(1)
    torch.manual_seed(0)
    import train
    base_kb = status_kb("VmRSS")
    args = train.Args(model=cfg["model"], dtype=cfg["dtype"], gradient_checkpointing=cfg["checkpointing"],
                      lora_r=cfg["lora_r"], batch_groups=cfg["micro_groups"], micro_groups=cfg["micro_groups"],
                      load_in_4bit=cfg["four_bit"])
    model, tok = train.build_model(args)
    built_kb = status_kb("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS from here on
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    P, G, Lp, T = cfg["micro_groups"], cfg["group_size"], cfg["prompt_tokens"], cfg["new_tokens"]
    g = torch.Generator().manual_seed(0)
    V = model.get_input_embeddings().num_embeddings
    for step in range(cfg["steps"]):
        groups = [{"prompt_ids": torch.randint(3, V, (Lp,), generator=g).tolist(), "policy_version": 0,
                   "meta": {"temperature": 1.0},
                   "completions": [{"token_ids": torch.randint(3, V, (T,), generator=g).tolist(),
                                    "logprobs": [-2.0] * T, "reward": float(i % 2)} for i in range(G)]}
                  for _ in range(P)]
        opt.zero_grad(set_to_none=True)
        train.train_step(model, groups, args, version=0, fresh_weights=False)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return {"base_mb": base_kb / 1024, "built_mb": built_kb / 1024, "hwm_mb": status_kb("VmHWM") / 1024,
            "trainable_dtypes": sorted({str(p.dtype) for p in params})}


def model_config(model: str) -> dict:
    import memory
    cfg, src = memory.config_for(model, hub=False)
    if cfg is None:
        raise SystemExit(f"no config for {model}: {src}")
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="local:SmolLM2-135M-Instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--checkpointing", default="off,on")
    p.add_argument("--four-bit", action="store_true")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--micro-groups", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    import memory
    arch = memory.Arch.from_config(model_config(a.model))
    lay = memory.Layout(prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens, group_size=a.group_size,
                        micro_groups=a.micro_groups)
    rows, bad = [], 0
    print(f"{a.model}: {a.micro_groups} prompts x {a.prompt_tokens} tokens, G={a.group_size} completions x "
          f"{a.new_tokens} tokens per micro-batch, LoRA r={a.lora_r}, {a.steps} steps")
    print(f"{'dtype':9s} {'ckpt':4s} {'measured MB':>11s} {'predicted MB':>12s} {'ratio':>6s}   (step part: measured / predicted)")
    for dtype in a.dtypes.split(","):
        for ck in a.checkpointing.split(","):
            cfg = {"model": a.model, "dtype": dtype, "checkpointing": ck, "lora_r": a.lora_r, "four_bit": a.four_bit,
                   "micro_groups": a.micro_groups, "group_size": a.group_size, "prompt_tokens": a.prompt_tokens,
                   "new_tokens": a.new_tokens, "steps": a.steps}
            # glibc keeps freed heap memory resident (its mmap threshold grows up to 32 MB after the first
            # free): fix it at 64 KiB so a freed tensor leaves RSS at once and RSS follows live memory
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True,
                                 env=env, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"{dtype}/{ck} failed:\n{out.stderr[-3000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            pred = memory.trainer_memory(arch, memory.Trainer(dtype, a.four_bit, ck == "on", a.lora_r), lay, cuda=False)
            measured = got["hwm_mb"] - got["base_mb"]
            predicted = pred["total"] / 2 ** 20
            ratio = measured / predicted
            step_meas, step_pred = got["hwm_mb"] - got["built_mb"], (pred["total"] - pred["weights"]) / 2 ** 20
            ok = abs(ratio - 1) <= a.tolerance
            bad += not ok
            print(f"{dtype:9s} {ck:4s} {measured:11.0f} {predicted:12.0f} {ratio:6.2f}   ({step_meas:.0f} / {step_pred:.0f})"
                  f"{'' if ok else '  <-- outside tolerance'}", flush=True)
            rows.append({**cfg, **got, "measured_mb": measured, "predicted_mb": predicted, "ratio": ratio,
                         "predicted_parts_mb": {k: v / 2 ** 20 for k, v in pred.items()}})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if bad:
        raise SystemExit(f"{bad} configuration(s) off the prediction by more than {a.tolerance:.0%}")


if __name__ == "__main__":
    main()
