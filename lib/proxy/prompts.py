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


class NotOpen(PromptError):
    """A participant asked for prompts of a dataset the run's owner has not opened (yet): the proxy answers that it
    waits (a paced lease: no grant; another: 503 with Retry-After, which a worker's client waits out)."""

    def __init__(self, dataset: str):
        super().__init__(f"dataset {dataset!r} is not open in this run yet: the run's trainer opens its task's dataset "
                         "when it starts (POST /v1/prompts/datasets); ask again")


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

    def open(self, dataset: str, size: int) -> dict | None:
        """The run's owner (its trainer, or the admin token) says the run has `dataset` of `size` prompts: the cursor
        record to journal, or None when it is open already with that size. Only the owner opens one: a participant
        that could would fix a dataset's size for the run (every honest lease then refused) or fill the table with
        made-up names (every dataset not yet leased refused)."""
        if dataset in self.table:
            if self.table[dataset]["size"] != size:
                raise PromptError(f"dataset {dataset!r} has size {self.table[dataset]['size']} in this run, not {size}")
            return None
        if len(self.table) >= self.max_datasets:
            raise PromptError(f"this run already has {self.max_datasets} datasets")
        self.table[dataset] = {"size": size, "epoch": 0, "pos": 0}
        return {"t": "cursor", "dataset": dataset, **self.table[dataset]}

    def reserve(self, dataset: str, size: int, n: int, owner: bool) -> tuple[list[tuple[int, range]], dict]:
        """Move the cursor past the next n positions: ([(epoch, positions)], the cursor record to journal).
        Cheap (the indices are computed afterwards, by indices()). owner: the caller may open the dataset (open());
        a participant's lease is of an open dataset, at its size, and of at most that many prompts."""
        if dataset not in self.table and not owner:
            raise NotOpen(dataset)
        self.open(dataset, size)
        cur = self.table[dataset]
        if not owner and n > size:
            raise PromptError(f"n {n} is more than dataset {dataset!r}'s {size} prompts")
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
