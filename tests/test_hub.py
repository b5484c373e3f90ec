"""--push-to-hub, checked at the HTTP boundary: huggingface_hub's own code runs unchanged
(`create_repo`, `create_commit` with its README validation and preupload, `create_tag`, `model_info`);
only its network layer is replaced, through `huggingface_hub.set_client_factory`, by an httpx2
MockTransport that answers as the Hub does. The fake asks for every file as a "regular" upload, so the
file contents travel inside the commit payload (the real Hub would take the weights through Xet,
which runs in Rust outside httpx): the test reads exactly what would land in the repository, then
loads it with PeftModel.from_pretrained on the base model.
"""
import base64
import json
import os
import re
import secrets

import httpx2
import pytest
import torch
from huggingface_hub import ModelCard, set_client_factory
from huggingface_hub.utils._http import default_client_factory

import common
import runconfig
import hub
import train
from conftest import ROOT

HF_TOKEN = "hf_FAKEpushtoken0123456789"
LICENSED_BASE = "acme/tiny-llama"   # the name the adapters below say they were trained on


class FakeModelHub:
    """Plays the Hub's model-repository API and records what was created, committed and tagged."""

    def __init__(self, offline_model_info: bool = False):
        self.requests: list[httpx2.Request] = []
        self.repos: dict[str, dict] = {}     # repo -> {"visibility": str, "commits": [{path: bytes}], "tags": {tag: oid}}
        self.offline_model_info = offline_model_info

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        path, method = request.url.path, request.method
        assert request.headers.get("authorization") == f"Bearer {HF_TOKEN}", path
        if path == f"/api/models/{LICENSED_BASE}" and method == "GET":
            if self.offline_model_info:
                raise httpx2.ConnectError("no network")
            return httpx2.Response(200, json={"id": LICENSED_BASE, "cardData": {"license": "apache-2.0"}})
        if path == "/api/repos/create":
            body = json.loads(request.content)
            repo = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
            self.repos.setdefault(repo, {"visibility": body.get("visibility"), "commits": [], "tags": {}})
            return httpx2.Response(200, json={"url": f"https://huggingface.co/{repo}", "name": repo})
        if path == "/api/validate-yaml":
            return httpx2.Response(200, json={})
        if m := re.fullmatch(r"/api/models/([\w.-]+/[\w.-]+)/preupload/main", path):
            files = json.loads(request.content)["files"]
            return httpx2.Response(200, json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                        for f in files]})
        if m := re.fullmatch(r"/api/models/([\w.-]+/[\w.-]+)/commit/main", path):
            lines = [json.loads(x) for x in request.content.decode().splitlines()]
            assert all(x["key"] in ("header", "file") for x in lines), "only regular files were asked for"
            files = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
            repo = self.repos[m[1]]
            repo["commits"].append({"message": lines[0]["value"]["summary"], "files": files})
            oid = f"{len(repo['commits']):040x}"
            return httpx2.Response(200, json={"commitUrl": f"https://huggingface.co/{m[1]}/commit/{oid}", "commitOid": oid})
        if m := re.fullmatch(r"/api/models/([\w.-]+/[\w.-]+)/tag/(\w+)", path):
            self.repos[m[1]]["tags"][json.loads(request.content)["tag"]] = m[2]
            return httpx2.Response(200, json={})
        return httpx2.Response(404, json={"error": f"fake hub: no route for {method} {path}"})


@pytest.fixture
def fake_hub(monkeypatch):
    def make(**kw) -> FakeModelHub:
        fake = FakeModelHub(**kw)
        set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(fake.handle)))
        return fake
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    yield make
    set_client_factory(default_client_factory)


def publish_trained_adapter(bucket, tiny_model, version: int, base_model: str):
    """A LoRA adapter with non-zero B (as after training), published as train.py does."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(version)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                          LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    with tempfile.TemporaryDirectory() as d:
        peft.save_pretrained(d)
        common.publish_adapter(bucket, d, version, step=version, base_model=base_model)


def logits_with(model_dir_or_none, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = PeftModel.from_pretrained(base, model_dir_or_none) if model_dir_or_none else base
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor([[1, 5, 9, 42, 7]])).logits


def test_push_adapter_builds_the_repository_and_card(fake_hub, bucket, run_name, tiny_model, tmp_path, monkeypatch):
    fake = fake_hub()
    publish_trained_adapter(bucket, tiny_model, 1, LICENSED_BASE)
    publish_trained_adapter(bucket, tiny_model, 2, LICENSED_BASE)
    rows = [{"step": s, "version": s, "reward/mean": r} for s, r in enumerate([0.25, 0.5, 0.75], 1)]
    bucket.put("metrics/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    for v, acc in ((0, 0.25), (1, 0.5), (2, 0.7)):
        bucket.put_json(f"adapters/v{v:06d}/eval_addition.json", {"version": v, "task": "addition", "n": 20, "accuracy": acc})
    # what the roles record at start; a secret in the environment must not reach the repository
    monkeypatch.setenv("PROXY_TOKEN", "proxy-secret-should-never-leave")
    import rollout
    runconfig.record_config(bucket, "rollout-w1", rollout.Args(model=tiny_model, task="addition", backend="hf"),
                         str(ROOT / "rollout.py"))

    url = hub.push_adapter(bucket, 2, "alice/tiny-grpo")
    repo = fake.repos["alice/tiny-grpo"]
    (commit,) = repo["commits"]
    assert repo["visibility"] == "private" and repo["tags"] == {"v2": f"{1:040x}"}   # the tag points at that commit
    assert url.startswith("https://huggingface.co/alice/tiny-grpo/commit/")
    assert commit["message"] == f"async-grpo run {run_name}: adapter v2 (step 2)"
    files = commit["files"]
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json", "README.md", "reward_curve.png",
                          "async_grpo.json"}
    assert files["adapter_model.safetensors"] == bucket.get("adapters/v000002/adapter_model.safetensors")[0]
    assert files["reward_curve.png"][:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == LICENSED_BASE

    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == LICENSED_BASE and card.data.license == "apache-2.0"
    assert card.data.library_name == "peft" and "grpo" in card.data.tags
    text = card.text
    assert "| adapter version | v2 (optimizer step 2) |" in text and "| task | `addition` |" in text
    assert "| reward, first 5 / last 5 logged steps | 0.375 / 0.375 (2 steps logged) |" in text  # steps <= 2 only
    for v, acc in ((0, "0.250"), (1, "0.500"), (2, "0.700")):
        assert f"| v{v} | addition | 20 | {acc} |" in text
    assert re.search(r"python rollout\.py .*# rollout-w1", text) and "![reward" in text
    assert 'PeftModel.from_pretrained(base, "alice/tiny-grpo")' in text
    for blob in files.values():
        assert b"proxy-secret-should-never-leave" not in blob and HF_TOKEN.encode() not in blob

    # what was pushed loads on the base model and is the version's weights
    d = tmp_path / "pushed"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    common.fetch_adapter(bucket, 2, tmp_path / "from-bucket")
    got, want, base = logits_with(d, tiny_model), logits_with(tmp_path / "from-bucket", tiny_model), logits_with(None, tiny_model)
    assert torch.equal(got, want) and not torch.allclose(got, base)


def test_license_is_unknown_offline_or_for_a_local_base(fake_hub, tiny_model):
    from huggingface_hub import HfApi
    fake_hub(offline_model_info=True)
    assert hub.base_license(HfApi(), LICENSED_BASE) == "unknown"
    assert hub.base_license(HfApi(), tiny_model) == "unknown"      # a local folder: nothing to ask


def submit_groups(proxy, n: int, G: int = 4):
    for i in range(n):
        comps = [{"token_ids": [11 + g, 12, 13], "logprobs": [-1.0, -2.0, -0.5], "reward": float(g % 2),
                  "finish_reason": "stop"} for g in range(G)]
        r = proxy.http.post("/v1/groups", json={
            "group_id": secrets.token_hex(8), "worker_id": "w1", "policy_version": 0, "prompt_ids": [1, 2, 3 + i],
            "completions": comps, "meta": {"temperature": 1.0, "reward_components": {"correct": 0.5}}})
        assert r.status_code == 200, r.text


def test_trainer_pushes_every_version_and_records_its_config(fake_hub, start_proxy, bucket, run_name, tiny_model,
                                                             monkeypatch):
    """train.main in this process (so the fake Hub answers it): 2 steps, --push-every 1 -> v1 and v2
    pushed and tagged, the final version not pushed twice; the trainer's config is in the bucket."""
    fake = fake_hub()
    proxy = start_proxy("--group-size", "4")
    monkeypatch.setenv("RUN_NAME", run_name)
    submit_groups(proxy, 4)
    args = train.Args(proxy_url=proxy.url, proxy_token=proxy.token, hf_token=None, model=tiny_model, max_steps=2,
                      batch_groups=2, lr=1e-3, lora_r=4, lora_alpha=8, lease_wait_s=5, trainer_id="t-push",
                      threads=1, push_to_hub="alice/tiny-trained", push_every=1, report_to="none")
    train.main(args)
    repo = fake.repos["alice/tiny-trained"]
    assert set(repo["tags"]) == {"v1", "v2"} and len(repo["commits"]) == 2
    assert [c["message"].rsplit(": ", 1)[1] for c in repo["commits"]] == ["adapter v1 (step 1)", "adapter v2 (step 2)"]
    card = ModelCard(repo["commits"][1]["files"]["README.md"].decode())
    assert card.data.license == "unknown" and card.data.base_model is None      # a local base folder
    assert re.search(r"python train\.py .*--push-to-hub alice/tiny-trained.*# train", card.text)
    (key,) = [k for k in bucket.list("config/") if k.startswith("config/train-")]
    cfg = bucket.get_json(key)
    assert cfg["args"]["max_steps"] == 2 and cfg["args"]["proxy_token"] == runconfig.REDACTED
    assert proxy.token not in json.dumps(cfg) and cfg["sha256"]["train.py"] == common.sha256_file(ROOT / "train.py")


def test_bad_push_target_fails_before_training(monkeypatch):
    with pytest.raises(SystemExit, match="expected ORG/NAME"):
        train.check_push_target(train.Args(push_to_hub="no-slash"))
    with pytest.raises(SystemExit, match="--push-every needs --push-to-hub"):
        train.check_push_target(train.Args(push_every=5))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", os.devnull + "-none")
    with pytest.raises(SystemExit, match="needs a Hugging Face token"):
        train.check_push_target(train.Args(push_to_hub="alice/x"))
