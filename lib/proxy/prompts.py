"""Prompt dispatch for the proxy: which prompt indices a worker gets next, so that N workers cover a
dataset without overlap. Per dataset a cursor (size, epoch, position) walks a seeded random permutation
of range(size), one per epoch; proxy.py journals every cursor move before it hands indices out, so no
index comes twice in an epoch across restarts either.

The permutation is computed one position at a time (nothing the size of the dataset is built, so a
2^22-prompt dataset costs no memory): a 4-round Feistel network on the smallest even number of bits
that covers the size, cycle-walking past values >= size. A Feistel network is a bijection on its
domain whatever its round function, and cycle-walking keeps one on range(size).
"""
from __future__ import annotations

import hashlib

M64 = (1 << 64) - 1


class PromptError(ValueError):
    """A prompt lease that cannot be served as asked (the proxy answers 409)."""


def _mix(z: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash (the Feistel round function)."""
    z = (z * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def shuffled(positions: range, size: int, key: str) -> list[int]:
    """The indices at `positions` of the permutation of range(size) seeded by `key` (~5 us an index)."""
    half = (max(2, (size - 1).bit_length()) + 1) // 2
    mask = (1 << half) - 1
    keys = [int.from_bytes(hashlib.blake2b(f"{key}:{r}".encode(), digest_size=8).digest(), "little") for r in range(4)]
    out = []
    for x in positions:
        while True:
            left, right = x >> half, x & mask
            for k in keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
            x = (left << half) | right
            if x < size:
                break
        out.append(x)
    return out


class Cursors:
    """dataset -> {size, epoch, pos}; at most `max_datasets` of them (the names are the clients')."""

    def __init__(self, seed: int, max_datasets: int = 64):
        self.seed, self.max_datasets, self.table = seed, max_datasets, {}

    def reserve(self, dataset: str, size: int, n: int) -> tuple[list[tuple[int, range]], dict]:
        """Move the cursor past the next n positions: ([(epoch, positions)], the cursor record to journal).
        Cheap (the indices are computed afterwards, by indices())."""
        if dataset not in self.table and len(self.table) >= self.max_datasets:
            raise PromptError(f"this run already has {self.max_datasets} datasets")
        cur = self.table.setdefault(dataset, {"size": size, "epoch": 0, "pos": 0})
        if cur["size"] != size:
            raise PromptError(f"dataset {dataset!r} has size {cur['size']} in this run, not {size}")
        spans = []
        while n:
            take = min(n, size - cur["pos"])
            spans.append((cur["epoch"], range(cur["pos"], cur["pos"] + take)))
            cur["pos"], n = cur["pos"] + take, n - take
            if cur["pos"] >= size:
                cur["epoch"], cur["pos"] = cur["epoch"] + 1, 0
        return spans, {"t": "cursor", "dataset": dataset, **cur}

    def apply(self, record: dict) -> None:
        """A journaled cursor record, at replay."""
        self.table[record["dataset"]] = {k: record[k] for k in ("size", "epoch", "pos")}

    def indices(self, dataset: str, size: int, spans: list[tuple[int, range]]) -> dict:
        return {"indices": [i for epoch, pos in spans for i in shuffled(pos, size, f"{self.seed}:{dataset}:{epoch}")],
                "epochs": [epoch for epoch, pos in spans for _ in pos]}
