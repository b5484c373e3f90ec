"""How train.py splits a rank's share of a step into forward/backward passes (micro-batches), so that a pass's
activation memory is bounded by a setting (--micro-tokens) and not by what a group carries.

A pass holds the activations of every row it runs: its rows x (the longest prompt + the longest completion among
them), since both are padded to the longest. Groups go into a pass whole, up to --micro-groups of them while the
pass stays within the budget; a group that alone is over it is run a few of its rows at a time (a `Piece` with
`rows`), each piece its own forward (the group's prompt computed again for each) and backward, its loss weighted
by its share of the batch, so the accumulated gradient is the one the whole group would give. One row is the
least a pass can take: a single row over the budget is run alone (the worker's --max-prompt-tokens and token
budgets bound it).

    python -c "import sys; sys.path[:0] = ['lib/shared']; import micro_batches as m; \\
print(m.plan([(700, [256] * 8), (700, [256] * 8)], micro_groups=2, budget=4096))"
"""
from __future__ import annotations

from typing import NamedTuple

# tokens a pass may hold when --micro-tokens is not given: without activation checkpointing every token of a
# pass keeps each layer's saved tensors (~1.2 MB a token for the local 135M model in float32: 4,096 tokens ~5 GB,
# docs/results/environments.md); with it, each layer's input only (~70 KB a token there), so 4x as many
WITHOUT_CHECKPOINTING, WITH_CHECKPOINTING = 4096, 16384


class Piece(NamedTuple):
    """Whole groups in one forward/backward (`rows` None), or the one group in `groups` in several, one for each
    [start, stop) range of its rows in `rows`."""
    groups: list[int]
    rows: list[tuple[int, int]] | None = None


def default_budget(checkpointing: bool) -> int:
    """--micro-tokens when it is not given: what a pass may hold with or without activation checkpointing."""
    return WITH_CHECKPOINTING if checkpointing else WITHOUT_CHECKPOINTING


def pass_tokens(shapes: list[tuple[int, list[int]]]) -> int:
    """Tokens a pass over these groups holds: (prompt length, completion lengths) each; every row is padded to the
    longest prompt plus the longest completion."""
    rows = sum(len(c) for _, c in shapes)
    return rows * (max(p for p, _ in shapes) + max(max(c, default=0) for _, c in shapes))


def plan(shapes: list[tuple[int, list[int]]], micro_groups: int, budget: int | None) -> list[Piece]:
    """The passes over groups 0..n-1 of `shapes` ((prompt length, completion lengths) each), in order: whole groups,
    at most `micro_groups` a pass and within `budget` tokens (pass_tokens); a group over the budget alone, in pieces
    of as many of its rows as fit (at least one a piece). budget None: no limit."""
    out: list[Piece] = []
    cur: list[int] = []
    for i, (p, comps) in enumerate(shapes):
        if cur and (len(cur) >= micro_groups or not fits([shapes[j] for j in cur] + [(p, comps)], budget)):
            out.append(Piece(cur))
            cur = []
        if fits([(p, comps)], budget) or len(comps) <= 1:
            cur.append(i)
            continue
        per = max(1, budget // (p + max(comps)))
        out.append(Piece([i], [(s, min(s + per, len(comps))) for s in range(0, len(comps), per)]))
    if cur:
        out.append(Piece(cur))
    return out


def fits(shapes: list[tuple[int, list[int]]], budget: int | None) -> bool:
    """Whether a pass over these groups stays within `budget` tokens (None: no limit)."""
    return budget is None or pass_tokens(shapes) <= budget
