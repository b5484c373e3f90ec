"""The configuration of every role start, in the bucket: config/{role}-{UTC time}-{random}.json.

Each role (train.py, rollout.py, evaluate.py, the proxy's startup) calls `record_config` once when it
starts, so a run can be reproduced from its bucket alone: the arguments, the command that sets them,
package versions, the sha256 of the script and of every module of ours it loaded, host, device, start
time, the non-secret environment. Secrets never enter it (see `role_config`). report.py prints them;
hub.py puts them in the model card. On Hugging Face Jobs this file travels beside the script.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shlex
import socket
import sys
import time
import uuid
from typing import Any

from common import Bucket, script_args, sha256_file

# versions worth knowing to reproduce a run (those installed; None where not)
RECORDED_PACKAGES = ("torch", "transformers", "peft", "vllm", "huggingface_hub", "datasets", "math-verify",
                     "trackio", "safetensors", "accelerate", "fastapi", "boto3")
# environment worth recording (RUN_PRESET: the launcher's preset, name@version, lib/jobs/presets.py; never a
# secret: those are matched by SECRET_NAME and left out)
RECORDED_ENV = ("RUN_PRESET", "BUCKET", "RUN_NAME", "S3_ENDPOINT_URL", "AWS_REGION", "PROXY_URL", "TRAINER_ID",
                "SPOOL_DIR", "REPORT_TO", "TRACKIO_PROJECT", "TRACKIO_SPACE_ID", "JOB_ID", "ACCELERATOR", "OMP_NUM_THREADS",
                "CUDA_VISIBLE_DEVICES", "HF_ENDPOINT")
# "token" as a word of the name (proxy_token, --hf-token, PROXY_TOKEN), not max_new_tokens; "api-key" as a flag too
SECRET_NAME = re.compile(r"(?<![a-z])token(?![a-z])|secret|password|passwd|credential|api[_-]?key|access[_-]?key"
                         r"|private[_-]?key", re.I)
REDACTED = "<redacted>"


def _redact_argv(argv: list[str]) -> list[str]:
    """--proxy-token X and --proxy-token=X keep the flag and lose the value."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append(REDACTED)
            hide = False
        elif a.startswith("--") and SECRET_NAME.search(a.split("=", 1)[0]):
            out.append(f"{a.split('=', 1)[0]}={REDACTED}" if "=" in a else a)
            hide = "=" not in a
        else:
            out.append(a)
    return out


def args_command(script: str, options: Any, argv: list[str]) -> str:
    """`python SCRIPT --flag value ...` for every argument given on the command line or different from
    its default (a default can depend on the machine: the rollout backend), in tyro's spelling
    (--max-steps 40, --no-scale-std); secrets are left out (they come from the environment)."""
    given = {a.split("=", 1)[0][2:].removeprefix("no-").replace("-", "_") for a in argv if a.startswith("--")}
    cmd = ["python", os.path.basename(script)]
    default = type(options)()
    for f in dataclasses.fields(options):
        v, flag = getattr(options, f.name), "--" + f.name.replace("_", "-")
        if (v == getattr(default, f.name) and f.name not in given) or SECRET_NAME.search(f.name) or v is None:
            continue
        if isinstance(v, bool):
            cmd.append(flag if v else f"--no-{flag[2:]}")
        elif isinstance(v, (list, tuple)):
            cmd += [x for item in v for x in (flag, str(item))]
        else:
            cmd += [flag, str(v)]
    return shlex.join(cmd)


def _installed(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def role_config(role: str, options: Any, script: str) -> dict:
    """Everything needed to run this role again: its options (any dataclass of them, or a dict; secrets
    redacted), the command that
    sets them, the argv it got, package versions, the sha256 of the script and of each of our modules
    it loaded, host, start time."""
    here = os.path.dirname(os.path.abspath(script))
    ours = {here, *(os.path.join(here, "lib", d) for d in os.listdir(os.path.join(here, "lib")))} \
        if os.path.isdir(os.path.join(here, "lib")) else {here}  # in a job every file is beside the script
    loaded = {os.path.abspath(f) for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)}
    files = [os.path.abspath(script)] + sorted(f for f in loaded if os.path.dirname(f) in ours and os.path.isfile(f))
    fields = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options)
    fields = {k: REDACTED if SECRET_NAME.search(k) and v else v for k, v in fields.items()}
    argv = [os.path.basename(script), *_redact_argv(script_args(sys.argv[1:]))]
    cfg = {"role": role, "started_at": time.time(), "started_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host": socket.gethostname(), "pid": os.getpid(), "script": os.path.basename(script),
           "command": (args_command(script, options, argv) if dataclasses.is_dataclass(options)
                       else "python " + shlex.join(argv)),
           "argv": argv, "args": fields,
           "sha256": {os.path.basename(f): sha256_file(f) for f in dict.fromkeys(files)},
           "versions": {"python": platform.python_version(), **{p: _installed(p) for p in RECORDED_PACKAGES}},
           "env": {k: os.environ[k] for k in RECORDED_ENV if os.environ.get(k)}}
    if "torch" in sys.modules:  # the proxy never loads it
        t = sys.modules["torch"]
        cfg["device"] = t.cuda.get_device_name(0) if t.cuda.is_available() else "cpu"
    # last line of defence: no secret value from the environment survives anywhere in the record
    text = re.sub(r"(//)[^/@\s]+@", rf"\1{REDACTED}@", json.dumps(cfg, default=str))  # user:pass@ in URLs
    for k, v in os.environ.items():
        if SECRET_NAME.search(k) and len(v) >= 6:
            text = text.replace(json.dumps(v)[1:-1], REDACTED)
    return json.loads(text)


def record_config(bucket: Bucket, role: str, options: Any, script: str) -> dict:
    """Write role_config(...) to config/{role}-{UTC time}-{random}.json, never over an earlier one
    (one object per start: a run's restarts stay visible); report.py prints them."""
    cfg = role_config(role, options, script)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(cfg["started_at"]))
    bucket.put_json(f"config/{role}-{stamp}-{uuid.uuid4().hex[:8]}.json", cfg, if_none_match=True)
    return cfg
