"""LRU-K against a plain reference that computes backward K-distances from full histories."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.kv.lru import LRUK


class ReferenceLRUK:
    """Straight from the paper's definition; O(n) per eviction."""

    def __init__(self, k: int) -> None:
        self.k, self.clock, self.times = k, 0, {}

    def touch(self, key, again: bool = False) -> None:
        self.clock += 1
        times = self.times.setdefault(key, [])
        if again and times:
            times.pop()
        times.append(self.clock)

    def inherit(self, key, sources) -> None:
        self.times[key] = sorted(t for source in sources for t in self.times.pop(source))

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
    st.tuples(st.sampled_from(["touch", "touch", "touch", "again", "remove", "evict", "succeed"]), st.integers(0, 7)),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 4), ops=operations)
def test_lru_k_evicts_the_largest_backward_k_distance(k, ops):
    lru, reference = LRUK(k), ReferenceLRUK(k)
    for step, (op, key) in enumerate(ops):
        if op in ("touch", "again"):
            lru.touch(key, again=op == "again")
            reference.touch(key, again=op == "again")
        elif op == "succeed":  # a new key takes the place of up to two (a prefix-cache entry superseding)
            sources = [source for source in (key, (key + 1) % 8) if source in reference.times]
            lru.inherit(100 + step, sources)
            reference.inherit(100 + step, sources)
            lru.touch(100 + step, again=key % 2 == 0)
            reference.touch(100 + step, again=key % 2 == 0)
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


def test_a_key_that_takes_the_place_of_a_twice_seen_one_outlives_a_scan():
    """A conversation's new turn supersedes its last: the new entry is the old one referenced again."""
    lru = LRUK(2)
    lru.touch("turn 1")
    lru.touch("document")  # referenced once, after the first turn
    lru.touch("turn 1")  # the second turn starts from the first...
    lru.inherit("turn 2", ["turn 1"])
    lru.touch("turn 2", again=True)  # ...and parks its own: the same reference, not a third
    assert "turn 1" not in lru and len(lru) == 2
    assert lru.evict() == "document"
