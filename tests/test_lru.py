"""LRU-K against a plain reference that computes backward K-distances from full histories."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compression.lru import LRUK


class ReferenceLRUK:
    """Straight from the paper's definition; O(n) per eviction."""

    def __init__(self, k: int) -> None:
        self.k, self.clock, self.times = k, 0, {}

    def touch(self, key) -> None:
        self.clock += 1
        self.times.setdefault(key, []).append(self.clock)

    def remove(self, key) -> None:
        del self.times[key]

    def victim(self, exclude=None):
        times = {key: t for key, t in self.times.items() if key != exclude}
        if not times:
            return None
        young = {key: t for key, t in times.items() if len(t) < self.k}
        if young:  # infinite backward K-distance; subsidiary policy LRU
            return min(young, key=lambda key: young[key][-1])
        return min(times, key=lambda key: times[key][-self.k])


operations = st.lists(
    st.tuples(st.sampled_from(["touch", "touch", "touch", "remove", "evict"]), st.integers(0, 7)), max_size=120
)


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 4), ops=operations)
def test_lru_k_evicts_the_largest_backward_k_distance(k, ops):
    lru, reference = LRUK(k), ReferenceLRUK(k)
    for op, key in ops:
        if op == "touch":
            lru.touch(key)
            reference.touch(key)
        elif op == "remove" and key in reference.times:
            lru.remove(key)
            reference.remove(key)
        elif op == "evict" and reference.times:
            expected = reference.victim()
            assert lru.evict() == expected
            reference.remove(expected)
        assert lru.victim() == reference.victim()
        assert lru.victim(exclude=key) == reference.victim(exclude=key)
        assert set(lru) == set(reference.times) and len(lru) == len(reference.times)


def test_lru_2_prefers_keys_seen_twice_over_a_scan():
    lru = LRUK(2)
    for key in ("hot", "hot", "warm", "warm"):
        lru.touch(key)
    for key in ("scan1", "scan2", "scan3"):  # a one-off scan must not flush the hot keys
        lru.touch(key)
    assert [lru.evict() for _ in range(3)] == ["scan1", "scan2", "scan3"]
    lru.touch("warm")  # warm's 2nd most recent reference is now younger than hot's
    assert lru.evict() == "hot"


def test_evicting_an_empty_lru_k_is_an_error():
    with pytest.raises(KeyError):
        LRUK(2).evict()
    with pytest.raises(ValueError):
        LRUK(0)
