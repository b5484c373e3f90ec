"""micro_batches.plan: how a rank's share of a step is split into forward/backward passes under --micro-groups and
--micro-tokens."""
from micro_batches import Piece, default_budget, pass_tokens, plan


def test_without_a_budget_passes_are_micro_groups_groups():
    shapes = [(10, [5] * 4)] * 5
    assert plan(shapes, 2, None) == [Piece([0, 1]), Piece([2, 3]), Piece([4])]


def test_groups_are_passed_whole_while_they_fit_and_a_group_over_it_a_few_rows_at_a_time():
    shapes = [(10, [5, 2]), (10, [3, 3]), (40, [60, 1, 1, 1]), (4, [1, 1])]
    # 2 rows x 15 = 30, the two together 4 x 15 = 60; the third holds 4 x 100 = 400
    assert pass_tokens(shapes[:2]) == 60 and pass_tokens(shapes[2:3]) == 400
    assert plan(shapes, 4, 60) == [Piece([0, 1]), Piece([2], [(0, 1), (1, 2), (2, 3), (3, 4)]), Piece([3])]
    assert plan(shapes, 4, 250) == [Piece([0, 1]), Piece([2], [(0, 2), (2, 4)]), Piece([3])]
    assert plan(shapes, 4, 59) == [Piece([0]), Piece([1]), Piece([2], [(0, 1), (1, 2), (2, 3), (3, 4)]), Piece([3])]
    assert plan(shapes, 1, 10_000) == [Piece([0]), Piece([1]), Piece([2]), Piece([3])]


def test_a_row_over_the_budget_runs_alone_and_every_row_is_run_once():
    shapes = [(3000, [2000, 10, 10]), (5, [1])]
    pieces = plan(shapes, 2, 100)
    assert pieces == [Piece([0], [(0, 1), (1, 2), (2, 3)]), Piece([1])]
    for budget in (1, 7, 50, 5000, 20000, None):
        rows = [(i, r) for p in plan(shapes, 2, budget) for i in p.groups
                for lo, hi in (p.rows or [(0, len(shapes[i][1]))]) for r in range(lo, hi)]
        assert rows == [(0, 0), (0, 1), (0, 2), (1, 0)], budget


def test_the_default_budget_follows_activation_checkpointing():
    assert default_budget(False) == 4096 and default_budget(True) == 16384
