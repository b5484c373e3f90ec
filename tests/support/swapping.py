"""A real rollout worker (rollout.start_worker: its hf engine, its adapter sync thread, its spool) through a round
in which the trainer's next version arrives: during a decode step, or during the prefill. The versions are the
trainer's LoRA (train.build_model) with random B matrices, published to the bucket and registered with the real
proxy; version 2 is registered from a forward hook on the engine's decoder (below the worker: it stands for the
clock, the moment the trainer publishes), which then waits until the worker's own sync thread has downloaded and
verified it, so the swap comes at the next boundary the worker asks about. The groups come back as the trainer
leases them, with the models of both versions to recompute their logprobs under each."""
from __future__ import annotations

import threading
import time

import torch

import common
import rollout
import train
from models import _causal_lm


def versions(tiny_model: str, tmp_path, bucket, proxy, n: int = 2) -> dict:
    """Versions 1..n: {version: the trainer's model holding its weights}, each published to the bucket; version 1
    registered with the proxy (the others: register(proxy, v))."""
    out = {}
    for v in range(1, n + 1):
        torch.manual_seed(100 + v)
        model, _ = train.build_model(train.Args(model=tiny_model, dtype="float32"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.2)
        model.save_pretrained(tmp_path / f"v{v}")
        common.publish_adapter(bucket, tmp_path / f"v{v}", v, v, tiny_model)
        out[v] = model
    register(proxy, 1)
    return out


def register(proxy, v: int) -> None:
    r = proxy.http.post("/v1/adapters", json={"version": v, "step": v, "published_at": time.time()})
    assert r.status_code == 200, r.text


def wait(pred, timeout: float, what: str) -> None:
    t0 = time.time()
    while not pred():
        assert time.time() - t0 < timeout, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.05)


def swap_round(tiny_model: str, proxy, token: str, tmp_path, models: dict, arrive: str, dataset: str = "addition",
               prompts: int = 2, G: int = 4, new_tokens: int = 12) -> tuple[list[dict], list[tuple[int, int]]]:
    """One round of a real worker on `token` (the run's, or a participant's) holding version 1, during which version 2
    arrives: arrive="decode" at its 4th decode step, "prefill" at its first prefill chunk (the prompts are longer
    than hf_engine.PREFILL_CHUNK). Returns the round's groups as the trainer leases them from the proxy, and the swaps
the worker recorded (rollout.Worker.swaps: (first token, version) after the prefill's)."""
    args = rollout.Args(proxy_url=proxy.url, proxy_token=token, model=tiny_model, backend="hf", task=dataset,
                        group_size=G, prompts_per_round=prompts, max_new_tokens=new_tokens, worker_id="swapper",
                        poll_s=1.0, spool_dir=str(tmp_path / "spool"), serve=False, dtype="float32")
    stop = threading.Event()
    worker = rollout.start_worker(args, stop)
    try:
        wait(lambda: worker.sync.ready is not None, 60, "version 1 to download")
        worker.take_new()
        assert worker.version == 1 and worker.engine.lora_loaded
        calls = {"prefill": 0, "decode": 0}

        def hook(module, args_, kwargs, output) -> None:
            calls["decode" if kwargs["input_ids"].shape[1] == 1 else "prefill"] += 1
            if calls[arrive] == (4 if arrive == "decode" else 1) and worker.sync.seen < 2:
                register(proxy, 2)  # the trainer publishes now; the worker's own thread fetches and verifies it
                wait(lambda: worker.sync.seen == 2, 60, "version 2 to download")
        handle = _causal_lm(worker.engine.model).get_decoder().register_forward_hook(hook, with_kwargs=True)
        try:
            task = worker.task
            lease = worker.client.post("/v1/prompts/lease", {"dataset": task.name, "size": len(task.prompts), "n": prompts})
            worker.run_round(lease)
        finally:
            handle.remove()
        assert worker.version == 2 and worker.row == {} and worker.spool.pending() == [], "the round took version 2 and sent"
        swaps = list(worker.swaps)
    finally:
        stop.set()
        worker.close()
    got = proxy.http.post("/v1/batches/lease", json={"num_groups": prompts}).json()
    assert len(got["groups"]) == prompts, got
    return got["groups"], swaps


def logprobs_under(model, g: dict) -> torch.Tensor:
    """The group's completions' logprobs under `model` (the trainer's forward, models.completion_logprobs), [G, T]."""
    from models import completion_logprobs
    with torch.no_grad():
        return completion_logprobs(model, [g["prompt_ids"]], [c["token_ids"] for c in g["completions"]],
                                   g["meta"].get("temperature", 1.0), pad=0)[0]
