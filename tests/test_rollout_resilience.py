"""Rollout-side resilience: the spool keeps finished groups across a proxy outage and a worker
restart; adapters that do not fit the served model are refused."""
import json
import os

import pytest

import common
import rollout
from test_proxy import group


def test_spool_survives_proxy_outage_and_resubmits_idempotently(start_proxy, tmp_path):
    spool, said = rollout.Spool(str(tmp_path), "run1", "w1"), []
    groups = [group() for _ in range(3)]
    for g in groups:
        spool.add(g)
    down = common.ProxyClient("http://127.0.0.1:9", "t", attempts=1)  # nothing listens there
    assert spool.flush(down, said.append) == [] and len(spool.pending()) == 3
    assert "proxy unreachable" in said[-1]

    proxy = start_proxy("--group-size", "4")
    up = common.ProxyClient(proxy.url, proxy.token)
    spool.add(groups[0])  # the same group again (a worker restarted mid-send): idempotent
    assert sorted(spool.flush(up, said.append)) == sorted((g["group_id"], "accepted") for g in groups)
    assert spool.pending() == [] and proxy.stats()["groups_accepted"] == 3

    bad = group(G=3)  # wrong group size: the proxy refuses it; it is kept aside, not retried forever
    spool.add(bad)
    assert spool.flush(up, said.append) == [(bad["group_id"], "refused")]
    assert os.listdir(tmp_path / "run1" / "w1" / "refused") == [f"{bad['group_id']}.json"]
    assert json.loads((tmp_path / "run1" / "w1" / "refused" / f"{bad['group_id']}.json").read_text()) == bad


def test_adapter_that_does_not_fit_is_refused():
    args = rollout.Args(model="m", max_lora_rank=16)
    names = {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp"}
    rollout.check_fits({"base_model": "m", "lora": {"r": 16, "target_modules": ["q_proj", "v_proj"]}}, args, names)
    # "all-linear" is saved as the full module paths
    rollout.check_fits({"base_model": "m", "lora": {"r": 16, "target_modules": sorted(names)}}, args, names)
    with pytest.raises(common.AdapterError, match="rank 32 above the limit 16"):
        rollout.check_fits({"base_model": "m", "lora": {"r": 32, "target_modules": ["q_proj"]}}, args, names)
    with pytest.raises(common.AdapterError, match=r"target modules \['wq'\] do not exist"):
        rollout.check_fits({"base_model": "m", "lora": {"r": 8, "target_modules": ["q_proj", "wq"]}}, args, names)
    with pytest.raises(common.AdapterError, match="trained on 'other'"):
        rollout.check_fits({"base_model": "other", "lora": {"r": 8, "target_modules": ["q_proj"]}}, args, names)
