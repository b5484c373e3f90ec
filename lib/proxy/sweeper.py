"""When the proxy's cyclic garbage is collected: on its own schedule, between turns of its housekeeping, not whenever
Python's allocation counter says so.

Python's automatic collector walks the young objects every few thousand allocations and the middle generation every
tenth time. At 1,000 workers the proxy holds ~1,700 requests open (long polls, paced leases), ~20,000 coroutines
that live about a trainer step: long enough to be promoted and walked again and again, 64-124 ms at each middle
collection, a few times a minute, and those pauses set the p99 of every answer (docs/results/fleet.md). The
cyclic garbage itself is small (tenacity's retry objects, botocore's parsers: ~12,000 objects a minute).

So the proxy freezes what its start loaded (never walked again), switches automatic collection off, and its
housekeeping calls `Sweeper.sweep` once a second: a full collection when `every_s` has passed, or sooner once
`max_new` container objects were allocated since the last one, so the garbage a run can leave is bounded by time
and by allocation alike. Each collection's pause and the unreachable objects it found are counted (GET /metrics:
proxy_gc_pause_seconds, proxy_gc_unreachable): over a days-long run they say whether garbage grows."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

EVERY_S = 60.0  # a full collection at most this often (~0.2 s at 1,000 workers, so a few probes a minute wait)
MAX_NEW = 2_000_000  # container objects allocated since the last collection that make one due early


@dataclass
class Sweeper:
    every_s: float = EVERY_S
    max_new: int = MAX_NEW
    observe: Callable[[float], None] = lambda seconds: None  # each collection's pause (telemetry's histogram)
    last: float = field(default_factory=time.monotonic)
    collections: int = 0
    unreachable: int = 0  # objects found in cycles, over all collections

    def start(self) -> None:
        """Called once the state is loaded: what is alive now is left out of every later walk, and from now on
        only `sweep` collects."""
        gc.collect()
        gc.freeze()
        gc.disable()

    def due(self, now: float) -> bool:
        return now - self.last >= self.every_s or gc.get_count()[0] >= self.max_new

    def sweep(self) -> bool:
        """Collect if due; True when it did."""
        now = time.monotonic()
        if not self.due(now):
            return False
        found = gc.collect()
        self.last = time.monotonic()
        self.collections += 1
        self.unreachable += found
        self.observe(self.last - now)
        return True

    def gauges(self) -> dict:
        return {"gc_collections": self.collections, "gc_unreachable": self.unreachable,
                "gc_allocated_since": gc.get_count()[0]}
