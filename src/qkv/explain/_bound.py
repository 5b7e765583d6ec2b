"""The size of a parsed worked-example document, with every alias counted by the nodes it expands to.

A YAML alias is one shared Python object, so ``&a [1, 1, …]``, ``&b [*a, *a, …]``, … nine levels down loads in
microseconds as a few hundred objects — and then expands to 10⁹ numbers in anything that walks it (putting
the fast-read rows back, converting a matrix). :func:`bound` counts the expanded document in time linear in
its distinct objects (each shared object's count is computed once and reused) and refuses it, naming the
top-level key where the count crossed the limit, before anything else walks it. A list that contains itself
(``&a [*a]``) is refused as well.
"""
from __future__ import annotations

import itertools

#: The most numbers a worked example may hold in all (its matrices, claims and variant keys together).
MAX_NUMBERS = 4_000_000
#: The most values of any kind (numbers, text, lists, mappings) — an alias of an empty list counts too.
MAX_NODES = 8_000_000


def bound(doc, where: str, error, *, rows: dict | None = None, max_numbers: int = MAX_NUMBERS,
          max_nodes: int = MAX_NODES) -> None:
    """Raise ``error(message)`` when ``doc`` expands to more than ``max_numbers`` numbers or ``max_nodes``
    values, or contains itself. ``rows``: the fast reader's placeholders ({text: (numbers, source)}), each
    standing for its row's numbers."""
    counter = _Counter({k: len(v[0]) for k, v in (rows or {}).items()}, max_nodes)
    numbers = nodes = 0
    for key, value in (doc.items() if isinstance(doc, dict) else [(None, doc)]):
        at = f"{where}: {_cut(key)}: " if key is not None else f"{where}: "
        n, k = counter.count(value, at, error)
        numbers, nodes = numbers + n, nodes + k + 1
        if numbers > max_numbers:
            raise error(f"{at}expected at most {max_numbers} numbers in a worked example, found {numbers} (an "
                        "alias counts as every number it stands for)")
        if nodes > max_nodes:
            raise error(f"{at}expected at most {max_nodes} values (numbers, text, lists, mappings) in a worked "
                        f"example, found {nodes} (an alias counts as every value it stands for)")


def _cut(key) -> str:
    s = " ".join(str(key).split())
    return s if len(s) <= 40 else s[:39] + "…"


def _all_numbers(items) -> bool:
    return all(issubclass(t, (int, float)) and not issubclass(t, bool) for t in set(map(type, items)))


class _Counter:
    """(numbers, values) of containers expanded, memoized by identity (a shared object is counted once)."""

    def __init__(self, row_lengths: dict, max_nodes: int):
        self.row_lengths, self.max_nodes = row_lengths, max_nodes
        self.memo: dict[int, tuple[int, int]] = {}

    def leaf(self, v) -> tuple[int, int]:
        if isinstance(v, str):
            n = self.row_lengths.get(v, 0)
            return n, n + 1
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return 1, 1
        return 0, 1

    def rows_at_once(self, obj) -> bool:
        """Count a list of rows of numbers, or of the fast reader's placeholders, at C speed (no walk, no memo
        per row); False when ``obj`` is not one."""
        if not isinstance(obj, list) or not obj:
            return False
        types = set(map(type, obj))
        if types == {str}:
            n = sum(map(self.row_lengths.get, obj, itertools.repeat(0)))
        elif types == {list}:
            n = sum(map(len, obj))                              # expanded, so bounded before it is walked
            if n > self.max_nodes or not _all_numbers(itertools.chain.from_iterable(obj)):
                return False
        else:
            return False
        self.memo[id(obj)] = (n, n + len(obj) + 1)
        return True

    def count(self, value, at: str, error) -> tuple[int, int]:
        """Iterative post-order over the containers under ``value``; a container on its own path is an error."""
        if not isinstance(value, (list, dict)):
            return self.leaf(value)
        memo, on_path = self.memo, set()
        stack: list[tuple[object, bool]] = [(value, False)]
        while stack:
            obj, done = stack.pop()
            oid = id(obj)
            children = list(obj.values()) if isinstance(obj, dict) else obj
            if done:
                on_path.discard(oid)
                n, k = 0, 1 + (len(obj) if isinstance(obj, dict) else 0)
                for c in children:
                    cn, ck = memo[id(c)] if isinstance(c, (list, dict)) else self.leaf(c)
                    n, k = n + cn, k + ck
                memo[oid] = (n, k)
            elif oid not in memo and not self.rows_at_once(obj):
                on_path.add(oid)
                stack.append((obj, True))
                for c in children:
                    if not isinstance(c, (list, dict)) or id(c) in memo or self.rows_at_once(c):
                        continue
                    if id(c) in on_path:
                        raise error(f"{at}a list or mapping that contains itself (a recursive alias); "
                                    "expected a worked example (matrices are lists of rows)")
                    stack.append((c, False))
        return memo[id(value)]
