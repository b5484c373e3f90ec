"""Metrics of every role: one JSON object per line in the run's bucket (metrics/NAME.jsonl), which
report.py reads, and optionally trackio for live dashboards."""
from __future__ import annotations

import atexit
import json
import math
import os
import resource
import signal
import sys
import threading
import time

from common import Bucket, BucketError, log


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Metrics:
    """One JSON object per line in `metrics/{name}.jsonl` in the bucket (and a local copy).
    S3 has no append, so the whole (small) file is re-uploaded at most every `flush_s`. Those
    uploads are best effort (one try: metrics never hold up a run; what failed goes with the next
    one); `flush(wait=True)` waits as long as the bucket's patience allows. Whatever is left is
    flushed at exit, and on SIGTERM when the process has no handler of its own (a role that has one
    flushes when it stops).

    With report_to="trackio" every row also goes to trackio under the same names (numbers only:
    lists and dicts stay in the JSONL): a local project by default, a Hugging Face Space when
    `trackio_space` is given. Unset arguments come from the environment (REPORT_TO, TRACKIO_PROJECT,
    TRACKIO_SPACE_ID), which is how the workers and the proxy are switched on."""

    def __init__(self, bucket: Bucket | None, name: str, flush_s: float = 10.0, report_to: str | None = None,
                 trackio_project: str | None = None, trackio_space: str | None = None, config: dict | None = None):
        self.bucket, self.name, self.flush_s = bucket, name, flush_s
        # a restarted role continues its file instead of overwriting it
        got = bucket.get(f"metrics/{name}.jsonl") if bucket is not None else None
        self.lines: list[str] = got[0].decode().splitlines() if got else []
        self._last, self._flushed = 0.0, len(self.lines)
        atexit.register(self.flush)
        report_to = os.environ.get("REPORT_TO", "") if report_to is None else report_to
        self.trackio: TrackioSink | None = None
        if "trackio" in report_to.split(","):
            run = bucket.run if bucket is not None else "local"
            self.trackio = TrackioSink(trackio_project or os.environ.get("TRACKIO_PROJECT") or "async-grpo",
                                       f"{run}-{name}", run, trackio_space or os.environ.get("TRACKIO_SPACE_ID"), config)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def log(self, row: dict) -> None:
        row = {"time": time.time(), **row, "mem/peak_rss_mb": round(peak_rss_mb(), 1)}
        # a NaN (say, a diverged grad norm) is logged as null rather than killing the run
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        self.lines.append(json.dumps(row, allow_nan=False, default=float))
        if self.trackio is not None:
            self.trackio.log(row)
        if time.time() - self._last > self.flush_s:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        self._last = time.time()
        if self.bucket is None or len(self.lines) == self._flushed:
            return
        n = len(self.lines)
        try:
            (self.bucket if wait else self.bucket.with_patience(0)).put(
                f"metrics/{self.name}.jsonl", ("\n".join(self.lines[:n]) + "\n").encode())
            self._flushed = n
        except BucketError as e:  # metrics must never kill a run
            log(f"metrics upload failed (will retry): {e}")

    def discard(self) -> None:
        """Never upload again (a trainer that lost its run must not overwrite the new owner's file)."""
        self.bucket = None

    def close(self) -> None:
        """Flush the JSONL (waiting as long as the bucket's patience allows) and finish the trackio run
        (its rows are written by a background thread)."""
        self.flush(wait=True)
        if self.trackio is not None:
            self.trackio.finish()


def _exit_on_sigterm(*_) -> None:
    raise SystemExit(128 + signal.SIGTERM)  # unwinds, so atexit handlers (the metrics flush) run


class TrackioSink:
    """A trackio run that takes metric rows. trackio is imported only here, when asked for (it
    brings gradio_client, orjson, pillow); a failure to start or to log is reported once and then
    ignored: the JSONL in the bucket is the record, the dashboard a view of it."""

    def __init__(self, project: str, run_name: str, group: str, space_id: str | None, config: dict | None):
        self.run = None
        try:
            import trackio
            # resume="allow": a restarted role continues its own trackio run
            self.run = trackio.init(project=project, name=run_name, group=group, space_id=space_id, config=config,
                                    resume="allow", embed=False)
            atexit.register(self.finish)  # a role that exits without close() still drains trackio's queue
        except Exception as e:  # noqa: BLE001 - any trackio failure: keep training, say why once
            print(f"trackio disabled: {type(e).__name__}: {e}", file=sys.stderr)

    def log(self, row: dict) -> None:
        if self.run is None:
            return
        # numbers only, under their own names; trackio reserves "time" and "step" (the step is the x axis)
        scalars = {k: v for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", "step")}
        step = row.get("step") if isinstance(row.get("step"), int) else None
        try:
            self.run.log(scalars, step=step)
        except Exception as e:  # noqa: BLE001
            print(f"trackio disabled: {type(e).__name__}: {e}", file=sys.stderr)
            self.run = None

    def finish(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:  # noqa: BLE001
                print(f"trackio finish failed: {type(e).__name__}: {e}", file=sys.stderr)
