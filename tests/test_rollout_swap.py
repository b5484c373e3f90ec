"""A worker on the hf backend handed a version whose LoRA has another shape than the one it serves (the trainer
restarted with another --lora-r, say): it refuses that version, says which and why, and keeps generating with
the adapter it has; it does not die, and asks for its grants at the version it holds. A real worker process, the
real proxy (--max-staleness 3: version 1's rounds stay trainable while runlib's stand-in trainer leases without
registering versions), the moto bucket, the tiny model."""
import re
import time

import common
import train
from runlib import worker_refuses_v2


def test_worker_refuses_an_adapter_of_another_rank_and_keeps_its_own(tiny_model, start_proxy, bucket, run_name,
                                                                      tmp_path):
    proxy = start_proxy("--group-size", "4", "--max-staleness", "3")

    def publish(v: int, r: int) -> None:
        model, _ = train.build_model(train.Args(model=tiny_model, lora_r=r, lora_alpha=2 * r))
        model.save_pretrained(tmp_path / f"v{v}")
        common.publish_adapter(bucket, tmp_path / f"v{v}", v, v, tiny_model)
        assert proxy.http.post("/v1/adapters", json={"version": v, "step": v, "published_at": time.time()}).is_success

    publish(1, r=4)
    text, after = worker_refuses_v2(tiny_model, proxy, run_name, tmp_path, lambda: publish(2, r=8), "version 2",
                                    rounds_after=4)
    assert re.search(r"refused version 2, keeping version 1: .*rank 8.*rank 4", text), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert len(after) >= 4 and set(after) == {"1"}  # it kept generating, with v1 only
