"""The proxy's own garbage collection (lib/proxy/sweeper.py): automatic collection off once started, a full
collection when the period has passed or enough container objects were allocated, each one counted and timed."""
import gc

import pytest

from sweeper import Sweeper


@pytest.fixture
def collector_restored():
    yield
    gc.unfreeze()
    gc.enable()


def cycles(n: int) -> None:
    """n lists each holding itself: garbage only the cyclic collector frees."""
    for _ in range(n):
        a = []
        a.append(a)


def test_a_started_sweeper_alone_collects_and_counts_what_it_found(collector_restored):
    pauses = []
    s = Sweeper(every_s=3600, max_new=10**9, observe=pauses.append)
    s.start()
    assert not gc.isenabled()
    cycles(5000)
    assert s.sweep() is False and s.collections == 0  # neither the period nor the allocations make one due
    s.last -= 3600
    assert s.sweep() is True
    assert s.collections == 1 and s.unreachable >= 5000 and len(pauses) == 1 and pauses[0] >= 0
    assert s.sweep() is False  # the period starts again from that collection
    g = s.gauges()
    assert g["gc_collections"] == 1 and g["gc_unreachable"] == s.unreachable


def test_enough_allocations_make_a_collection_due_before_its_period(collector_restored):
    s = Sweeper(every_s=3600, max_new=20_000)
    s.start()
    keep = [[] for _ in range(25_000)]  # container objects alive: the allocation count grows past max_new
    assert s.sweep() is True and s.collections == 1
    assert gc.get_count()[0] < 20_000 and s.sweep() is False
    del keep
