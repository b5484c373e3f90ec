"""A finished local run's folder read as its bucket. `bash launch_jobs.sh --local` keeps its bucket in a local S3
server that stops with the run; report.py copies what outlives it into runs/NAME/ under the bucket's own keys
(metrics/, adapters/vNNNNNN/ with their meta.json), and evaluate.py --run-dir runs/NAME reads the adapters from
there, sha256-checked as from a bucket (common.fetch_adapter), and writes its results there.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class RunFolder:
    """The calls evaluate.py and fetch_adapter make of common.Bucket, on files: key `adapters/v000012/meta.json` is
    the file ROOT/adapters/v000012/meta.json."""

    def __init__(self, root: str):
        self.root = Path(root)
        if not self.root.is_dir():
            raise SystemExit(f"--run-dir {root}: no such folder (a local run's is runs/NAME)")
        self.bucket, self.run = "folder", str(self.root)  # where messages say a key is

    def _path(self, rel: str) -> Path:
        p = (self.root / rel).resolve()
        if self.root.resolve() not in p.parents:
            raise ValueError(f"key {rel!r} is outside {self.root}")
        return p

    def get(self, rel: str) -> tuple[bytes, str] | None:
        p = self._path(rel)
        return (p.read_bytes(), "") if p.is_file() else None

    def get_json(self, rel: str) -> Any | None:
        got = self.get(rel)
        return json.loads(got[0]) if got else None

    def put(self, rel: str, data: bytes, **_) -> str:
        p = self._path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return ""

    def put_json(self, rel: str, obj: Any, **kw) -> str:
        return self.put(rel, json.dumps(obj).encode(), **kw)

    def list(self, prefix: str) -> list[str]:
        keys = [str(Path(d, f).relative_to(self.root)) for d, _, fs in os.walk(self.root) for f in fs]
        return sorted(k for k in keys if k.startswith(prefix))
