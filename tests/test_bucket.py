"""Versioned adapter publish/fetch against the real local S3 server."""
import json
from pathlib import Path

import pytest

import common


def write_adapter(d: Path, payload: bytes, r: int = 4) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_model.safetensors").write_bytes(payload)
    (d / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 2 * r, "target_modules": ["v_proj", "q_proj"]}))
    return d


def test_publish_then_fetch_verifies(bucket, tmp_path):
    meta = common.publish_adapter(bucket, write_adapter(tmp_path / "a", b"weights-1"), 1, 10, "base")
    assert bucket.get_json("adapters/latest.json")["version"] == 1
    assert meta["lora"] == {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    got = common.fetch_adapter(bucket, 1, tmp_path / "out")
    assert got["files"]["adapter_model.safetensors"] == common.sha256_file(tmp_path / "out" / "adapter_model.safetensors")
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == b"weights-1"


def test_corrupt_or_partial_version_is_refused(bucket, tmp_path):
    common.publish_adapter(bucket, write_adapter(tmp_path / "a", b"weights-1"), 1, 1, "base")
    # flip one byte of the weights after publishing
    data = bytearray(bucket.get("adapters/v000001/adapter_model.safetensors")[0])
    data[3] ^= 0x01
    bucket.put("adapters/v000001/adapter_model.safetensors", bytes(data))
    with pytest.raises(common.AdapterError, match="sha256"):
        common.fetch_adapter(bucket, 1, tmp_path / "out")
    # files uploaded but no meta.json yet (a trainer killed mid-publish)
    bucket.put("adapters/v000002/adapter_model.safetensors", b"half")
    with pytest.raises(common.AdapterError, match="no meta.json"):
        common.fetch_adapter(bucket, 2, tmp_path / "out2")


def test_a_file_a_worker_already_verified_is_not_fetched_again(bucket, tmp_path):
    """adapter_config.json is the same in every version of a run: a worker writes it from KnownFiles (by its
    sha256), so deleting it from the bucket does not break the next fetch; a changed one is fetched."""
    known = common.KnownFiles()
    common.publish_adapter(bucket, write_adapter(tmp_path / "a", b"weights-1"), 1, 1, "base")
    common.fetch_adapter(bucket, 1, tmp_path / "v1", known)
    common.publish_adapter(bucket, write_adapter(tmp_path / "b", b"weights-2"), 2, 2, "base")
    bucket.s3.delete_object(Bucket=bucket.bucket, Key=bucket.key("adapters/v000002/adapter_config.json"))
    with pytest.raises(common.AdapterError, match="adapter_config.json is missing"):
        common.fetch_adapter(bucket, 2, tmp_path / "v2-afresh")  # without it, the file is fetched (and gone)
    meta = common.fetch_adapter(bucket, 2, tmp_path / "v2", known)
    assert common.sha256_file(tmp_path / "v2" / "adapter_config.json") == meta["files"]["adapter_config.json"]
    assert (tmp_path / "v2" / "adapter_model.safetensors").read_bytes() == b"weights-2"
    common.publish_adapter(bucket, write_adapter(tmp_path / "c", b"weights-3", r=8), 3, 3, "base")  # another shape
    meta = common.fetch_adapter(bucket, 3, tmp_path / "v3", known)
    assert json.loads((tmp_path / "v3" / "adapter_config.json").read_text())["r"] == 8
    assert common.sha256_file(tmp_path / "v3" / "adapter_config.json") == meta["files"]["adapter_config.json"]


def test_versions_only_increase_and_pointer_is_conditional(bucket, tmp_path):
    common.publish_adapter(bucket, write_adapter(tmp_path / "a", b"1"), 1, 1, "base")
    common.publish_adapter(bucket, write_adapter(tmp_path / "b", b"2"), 2, 2, "base")
    with pytest.raises(common.ConflictError, match="already at version 2"):
        common.publish_adapter(bucket, write_adapter(tmp_path / "c", b"x"), 2, 3, "base")
    # a writer holding a stale ETag loses the conditional write of the pointer
    _, etag = bucket.get("adapters/latest.json")
    bucket.put_json("adapters/latest.json", {"version": 3, "step": 3, "created_at": 0}, if_match=etag)
    with pytest.raises(common.ConflictError):
        bucket.put_json("adapters/latest.json", {"version": 3, "step": 3, "created_at": 0}, if_match=etag)
    with pytest.raises(common.ConflictError):
        bucket.put_json("adapters/latest.json", {"version": 9}, if_none_match=True)
    assert bucket.get_json("adapters/latest.json")["version"] == 3


def test_unreachable_bucket_names_endpoint_bucket_and_key():
    b = common.Bucket(bucket="nowhere", run="r", endpoint="http://127.0.0.1:9", patience_s=0)  # no waiting
    with pytest.raises(common.BucketError, match=r"s3://nowhere/r/adapters/latest.json at http://127.0.0.1:9"):
        b.get("adapters/latest.json")
