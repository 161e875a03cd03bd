"""Pack by token budget: the one grouping rule of extraction units and training batches.

DESIGN.md: batches are counted in tokens, never in samples. Both the extraction units (one verifier prefill
each, ``extract.max_tokens_per_batch``) and the training steps (one packed sequence per worker,
``train.max_tokens_per_batch``) group consecutive items greedily with :func:`pack_by_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def pack_by_tokens(items: Iterable[T], max_tokens: int, length: Callable[[T], int]) -> Iterator[list[T]]:
    """Group ``items``, in order, into lists of at most ``max_tokens`` tokens (``length(item)`` tokens each).

    A single item longer than ``max_tokens`` forms a group alone (never split, never dropped). Lazy: items are
    read only as far as the groups yielded need.
    """
    cur: list[T] = []
    n = 0
    for item in items:
        t = length(item)
        if cur and n + t > max_tokens:
            yield cur
            cur, n = [], 0
        cur.append(item)
        n += t
    if cur:
        yield cur
