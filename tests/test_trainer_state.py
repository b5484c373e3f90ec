"""Trainer checkpoints (round trip through the real S3 server) and the one-trainer-per-run claim."""
import pytest
import torch

import common
import train
import trainer_state


def _model(tiny_model):
    args = train.Args(model=tiny_model, lora_r=4, lora_alpha=8)
    model, _ = train.build_model(args)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched, params


def test_checkpoint_round_trip(tiny_model, bucket):
    model, opt, sched, params = _model(tiny_model)
    for _ in range(2):  # non-trivial optimizer state and LoRA B != 0
        opt.zero_grad()
        model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.pow(2).mean().backward()
        opt.step()
        sched.step()
    state = {"step": 7, "version": 7, "acked": [{"batch_id": "b1", "groups": ["g1", "g2"]}]}
    trainer_state.save_checkpoint(bucket, model, opt, sched, state)
    rng_next = torch.rand(3)

    model2, opt2, sched2, params2 = _model(tiny_model)
    assert not all(torch.equal(a, b) for a, b in zip(params, params2))
    torch.manual_seed(123)
    got = trainer_state.load_checkpoint(bucket, model2, opt2, sched2)
    assert got == state
    assert all(torch.equal(a, b) for a, b in zip(params, params2))
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    assert sched2.last_epoch == sched.last_epoch == 2
    assert torch.equal(torch.rand(3), rng_next)  # RNG continues where the checkpoint left it


def test_corrupt_checkpoint_refused(tiny_model, bucket):
    model, opt, sched, _ = _model(tiny_model)
    trainer_state.save_checkpoint(bucket, model, opt, sched, {"step": 1, "version": 1, "acked": []})
    key = "checkpoints/step_00000001/trainer_state.pt"
    data = bytearray(bucket.get(key)[0])
    data[-5] ^= 0xFF
    bucket.put(key, bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        trainer_state.load_checkpoint(bucket, model, opt, sched)


@pytest.mark.parametrize("protocol", [None, common.PROTOCOL - 1, common.PROTOCOL + 1])
def test_a_checkpoint_of_another_protocol_is_refused(tiny_model, bucket, protocol):
    """A checkpoint records the protocol that wrote it (meta.json); one of another protocol (absent: from before
    protocols were numbered) stops the trainer before anything is loaded, naming both protocols and what to do."""
    model, opt, sched, params = _model(tiny_model)
    trainer_state.save_checkpoint(bucket, model, opt, sched, {"step": 3, "version": 3, "trained": {}})
    key = "checkpoints/step_00000003/meta.json"
    meta = bucket.get_json(key)
    assert meta["protocol"] == common.PROTOCOL
    bucket.put_json(key, {k: v for k, v in meta.items() if k != "protocol"} if protocol is None
                    else {**meta, "protocol": protocol})
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(SystemExit) as e:
        trainer_state.load_checkpoint(bucket, model, opt, sched)
    theirs = "1 (from before protocols were numbered)" if protocol is None else str(protocol)
    assert f"speaks protocol {theirs}; this code speaks protocol {common.PROTOCOL}" in str(e.value), e.value
    assert "checkpoints/step_00000003" in str(e.value)
    assert "--fresh" in str(e.value) and "new run" in str(e.value) and "wrote it" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, params))  # nothing loaded


def test_second_trainer_fails_at_once(bucket):
    etag = trainer_state.claim_run(bucket, "trainer-a", ttl=60)
    with pytest.raises(SystemExit, match="another trainer .'trainer-a'"):
        trainer_state.claim_run(bucket, "trainer-b", ttl=60)
    etag = trainer_state.heartbeat(bucket, "trainer-a", etag)
    trainer_state.claim_run(bucket, "trainer-a", ttl=60)  # the same trainer restarted takes over
    with pytest.raises(trainer_state.TakenOver, match="taken over by another trainer"):
        trainer_state.heartbeat(bucket, "trainer-a", etag)  # our old ETag is gone: someone else wrote it
    trainer_state.claim_run(bucket, "trainer-b", ttl=0)  # a dead owner (heartbeat older than ttl) is replaced


def test_heartbeats_from_two_threads_are_not_a_takeover(bucket):
    """The trainer heartbeats from its main loop and from the thread that asks for the next batch (prefetch):
    two conditional writes on the same ETag at once must not read as another trainer's. Found by test_chaos:
    after the outages the prefetch thread, starved, heartbeat as the main loop did, and the trainer stopped."""
    import threading
    owner = trainer_state.Owner(bucket, "trainer-a", ttl=60)
    lost, go = [], threading.Barrier(4)

    def beat() -> None:
        go.wait()
        for _ in range(15):
            try:
                owner.check()
            except trainer_state.TakenOver as e:
                lost.append(e)
    threads = [threading.Thread(target=beat) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not lost, lost[0]
    trainer_state.claim_run(bucket, "trainer-a", ttl=60)  # a real takeover is still seen
    with pytest.raises(trainer_state.TakenOver):
        owner.check()


def test_final_registration_of_a_version_the_proxy_adopted(tiny_model, start_proxy, bucket, tmp_path):
    """The last version published and checkpointed, then the proxy restarts and adopts it from
    adapters/latest.json as not final: the trainer's final registration publishes the same weights
    once more and registers that as final; a relaunch after that finds it done and does nothing."""
    import proxy_client
    model, _, _, _ = _model(tiny_model)
    args = train.Args(model=tiny_model, lora_r=4, lora_alpha=8)
    model.save_pretrained(tmp_path / "v1")
    common.publish_adapter(bucket, tmp_path / "v1", 1, 1, tiny_model)
    proxy = start_proxy("--group-size", "4")  # started after the publish: it adopts version 1
    client = proxy_client.ProxyClient(proxy.url, proxy.token)
    assert {k: client.get("/v1/adapters/latest")[k] for k in ("version", "done")} == {"version": 1, "done": False}
    owner = trainer_state.Owner(bucket, "t1", ttl=60)
    train.register_final(client, bucket, owner, model, args, 1, 1)
    assert {k: client.get("/v1/adapters/latest")[k] for k in ("version", "done")} == {"version": 2, "done": True}
    meta = bucket.get_json("adapters/v000002/meta.json")
    assert meta["files"] == bucket.get_json("adapters/v000001/meta.json")["files"]  # the same weights
    train.register_final(client, bucket, owner, model, args, 2, 1)  # a relaunch after the registration
    assert client.get("/v1/adapters/latest")["version"] == 2 and bucket.get_json("adapters/latest.json")["version"] == 2
