"""LRU-K replacement (O'Neil, O'Neil and Weikum, 1993) with O(1) touch, insert, remove and evict.

The victim is the key with the largest backward K-distance: the one whose K-th most recent
reference is oldest. Keys referenced fewer than K times have an infinite distance and go first;
among them the subsidiary policy is LRU (least recent last reference), as the paper suggests.
References are numbered by a logical clock, so distances never tie otherwise.

Why it is O(1): every key keeps its last (up to) K references as nodes of one list ordered by
time. A touch appends a node at the tail and, once a key has K + 1, unlinks its oldest. When
every key has K references, the head of that list is the oldest reference held by anyone; it
cannot be a key's newer reference (that key's K-th most recent would be older still and in the
list), so it is the K-th most recent reference of the victim.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Ref:
    key: Hashable
    time: int
    prev: _Ref | None = None
    next: _Ref | None = None


@dataclass
class _History:
    refs: list[_Ref] = field(default_factory=list)  # oldest first, at most K


class LRUK:
    def __init__(self, k: int = 2) -> None:
        if k < 1:
            raise ValueError("k must be at least 1")
        self.k = k
        self._clock = 0
        self._history: dict[Hashable, _History] = {}
        self._young: OrderedDict[Hashable, None] = OrderedDict()  # fewer than K references, LRU order
        self._head: _Ref | None = None  # every kept reference, oldest first
        self._tail: _Ref | None = None

    def __len__(self) -> int:
        return len(self._history)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._history

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._history)

    def touch(self, key: Hashable, again: bool = False) -> None:
        """Record a reference to `key`, inserting it if new; `again`: the same reference as the key's
        latest, made again now (it moves to now rather than counting twice)."""
        history = self._history.setdefault(key, _History())
        if again and history.refs:
            self._unlink(history.refs.pop())
        self._clock += 1
        history.refs.append(self._append(_Ref(key, self._clock)))
        if len(history.refs) > self.k:
            self._unlink(history.refs.pop(0))
        if len(history.refs) < self.k:
            self._young[key] = None
            self._young.move_to_end(key)
        else:
            self._young.pop(key, None)

    def inherit(self, key: Hashable, sources: list[Hashable]) -> None:
        """A new `key` takes the place of `sources`, which leave: their K most recent references become
        its own. Touch it next (its latest reference must be the newest of all: the young keys' order)."""
        refs = sorted((ref for source in sources for ref in self._history.pop(source).refs), key=lambda r: r.time)
        for source in sources:
            self._young.pop(source, None)
        for ref in refs[: -self.k]:
            self._unlink(ref)
        for ref in refs[-self.k :]:
            ref.key = key
        self._history[key] = _History(refs[-self.k :])

    def remove(self, key: Hashable) -> None:
        history = self._history.pop(key)
        for ref in history.refs:
            self._unlink(ref)
        self._young.pop(key, None)

    def victim(self, exclude: Hashable | None = None) -> Hashable | None:
        """The key to evict next, other than `exclude` (None if there is none), without removing it.

        Skipping `exclude` costs at most K + 1 steps: its own references are all that can come first.
        """
        for key in itertools.islice(self._young, 2):
            if key != exclude:
                return key
        ref = self._head
        while ref is not None and (ref.key == exclude or ref.key in self._young):
            ref = ref.next
        return ref.key if ref is not None else None

    def evict(self) -> Hashable:
        key = self.victim()
        if key is None:
            raise KeyError("evict from an empty LRU-K")
        self.remove(key)
        return key

    # ----- the time-ordered list ---------------------------------------------------------
    def _append(self, ref: _Ref) -> _Ref:
        ref.prev = self._tail
        if self._tail is not None:
            self._tail.next = ref
        self._tail = ref
        if self._head is None:
            self._head = ref
        return ref

    def _unlink(self, ref: _Ref) -> None:
        if ref.prev is not None:
            ref.prev.next = ref.next
        else:
            self._head = ref.next
        if ref.next is not None:
            ref.next.prev = ref.prev
        else:
            self._tail = ref.prev
        ref.prev = ref.next = None
