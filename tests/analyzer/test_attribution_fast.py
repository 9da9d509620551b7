"""`attribution.comparable`'s dense fast path and `group_transfer` give what the general rule
gives: on windows of many rows where some members disagree on the ops they ran, some are
missing, some are alone in their cell, and a rank has two aggregates in one cell (a pair's send
and receive). The reference below is written out cell by cell, independently of both."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from vigil.analyzer import attribution


def _window(seed: int, *, rows: int = 9, ranks: int = 12, row_stride: int = 1) -> (
    attribution.AggColumns
):  # fmt: skip
    rng = random.Random(seed)
    parts = []
    for row in range(rows):
        for key in range(5):
            mode = rng.choice(["agree", "agree", "disagree", "tie", "lone", "missing"])
            members = list(range(ranks))
            if mode == "lone":
                members = [rng.randrange(ranks)]
            elif mode == "missing":
                members = rng.sample(members, rng.randrange(2, ranks))
            if key == 4 and len(members) > 1:
                members.append(members[0])  # one rank's send and receive in a pair's cell
            for i, col in enumerate(members):
                count, seq = 3, 100 + row
                if mode == "disagree" and rng.random() < 0.3:
                    count, seq = rng.choice([(1, 100 + row), (3, 99 + row), (2, 98 + row)])
                if mode == "tie" and i % 2:
                    count, seq = 3, 101 + row  # two agreeing sets of the same size
                total = rng.choice([0.0, rng.uniform(0.01, 0.3)])
                parts.append(
                    (row * row_stride, col, key, count, seq, total, rng.uniform(0.0, total),
                     bool(key % 2), 4096 * (key + 1))
                )  # fmt: skip
    rng.shuffle(parts)
    fields = list(zip(*parts, strict=True))
    ints = lambda i: np.asarray(fields[i], dtype=np.int64)  # noqa: E731
    return attribution.AggColumns(
        row=ints(0), col=ints(1), key=ints(2), count=ints(3), last_seq=ints(4),
        total_s=np.asarray(fields[5]), last_s=np.asarray(fields[6]),
        overlapped=np.asarray(fields[7], dtype=bool), nbytes=ints(8),
    )  # fmt: skip


def _reference_ok(c: attribution.AggColumns) -> list[bool]:
    """Per aggregate: in its (row, key) cell's largest set agreeing on (last_seq, count) (ties:
    the smallest pair), and that set has two members."""
    sets: dict[tuple[int, int], dict[tuple[int, int], int]] = defaultdict(dict)
    for r, k, s, n in zip(c.row.tolist(), c.key.tolist(), c.last_seq.tolist(), c.count.tolist(),
                          strict=True):  # fmt: skip
        sets[(r, k)][(s, n)] = sets[(r, k)].get((s, n), 0) + 1
    chosen = {cell: min(found, key=lambda p: (-found[p], p)) for cell, found in sets.items()}
    return [
        (s, n) == chosen[(r, k)] and sets[(r, k)][(s, n)] >= 2
        for r, k, s, n in zip(c.row.tolist(), c.key.tolist(), c.last_seq.tolist(),
                              c.count.tolist(), strict=True)
    ]  # fmt: skip


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("row_stride", [1, 100_000])  # dense cells, and too sparse to count
def test_fast_comparable_equals_the_general_rule(seed: int, row_stride: int) -> None:
    c = _window(seed, row_stride=row_stride)
    inv, ok, groups = attribution.comparable(c)
    ref_inv, ref_ok, ref_groups = attribution.comparable_general(c)
    assert groups == ref_groups
    np.testing.assert_array_equal(inv, ref_inv)
    np.testing.assert_array_equal(ok, ref_ok)
    assert ok.tolist() == _reference_ok(c)
    assert 0 < ok.sum() < ok.size  # some compared, some left out


@pytest.mark.parametrize("seed", [5, 6])
def test_group_transfer_equals_a_cell_by_cell_reference(seed: int) -> None:
    c = _window(seed)
    g = attribution.group_transfer(c)
    ok = _reference_ok(c)
    cells: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, compared in enumerate(ok):
        if compared:
            cells[(int(c.row[i]), int(c.key[i]))].append(i)
    ordered = sorted(cells)
    assert list(zip(g.row.tolist(), g.key.tolist(), strict=True)) == ordered
    expect = []
    for cell in ordered:
        at = cells[cell]
        min_total = min(c.total_s[i] for i in at)
        min_last = min(c.last_s[i] for i in at)
        i = at[0]  # members agree on count, and overlapped is per key here
        expect.append(
            min_total if c.overlapped[i] else min(min_total, c.count[i] * min_last)
        )  # fmt: skip
    np.testing.assert_array_equal(g.transfer_s, expect)
    members = g.members(list(range(len(ordered))))
    assert members == [tuple(sorted(int(c.col[i]) for i in cells[cell])) for cell in ordered]
    assert any(len(set(m)) < len(m) for m in members)  # a send-and-receive rank counted twice
    assert g.members([2, 0]) == [members[2], members[0]]  # in the order asked


def test_attribute_equals_itself_with_the_general_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _window(7)
    fast = attribution.attribute(c, (9, 12))
    monkeypatch.setattr(attribution, "comparable", attribution.comparable_general)
    general = attribution.attribute(c, (9, 12))
    for name in ("wait_s", "hidden_wait_s", "transfer_s"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(general, name))
    assert np.isfinite(fast.wait_s).sum() > 50
