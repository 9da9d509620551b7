"""Stack dump parsing (py-spy and faulthandler) and grouping by identity."""

from __future__ import annotations

from pathlib import Path

from vigil.analyzer import stacks

PYSPY = """Process 7: python train.py
Python v3.11.7 (/usr/bin/python3)

Thread 7 (idle): "pin_memory"
    wait (threading.py:331)
Thread 8 (active): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2501)
    train_step (train.py:88)
"""

FAULTHANDLER = """Thread 0x00007f1 (most recent call first):
  File "threading.py", line 331 in wait

Current thread 0x00007f2 (most recent call first):
  File "torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "train.py", line 88 in train_step
"""


def test_main_thread_of_both_formats_parses_to_the_same_identity() -> None:
    expected = (
        "all_reduce (torch/distributed/distributed_c10d.py:2501)",
        "train_step (train.py:88)",
    )
    assert stacks.parse(PYSPY) == expected
    assert stacks.parse(FAULTHANDLER) == expected
    assert stacks.parse("no stack here") == ()


def test_groups_are_largest_first_and_ranks_come_from_file_names() -> None:
    a, b = ("f (x.py:1)",), ("g (y.py:2)",)
    assert stacks.group({3: a, 1: b, 2: a}) == [([2, 3], a), ([1], b)]
    assert stacks.rank_of(Path("stacks-rank-00012.txt")) == 12
    assert stacks.rank_of(Path("stacks.txt")) is None
