"""`SaveAgreement` between ranks: every rank saves a requested checkpoint at the same step end,
once per request, in rounds spaced by the agreed gap (a real 2-rank gloo agreement runs in the
HF and Lightning job tests; here two agreements in one process share an in-memory all-reduce,
so the rounds and step ends of each case are exact)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from vigil.integrations import save_agreement
from vigil.integrations.save_agreement import MAX_GAP_STEPS, SaveAgreement


class _Done:
    def wait(self) -> bool:
        return True


class _Exchange:
    """An all-reduce (MAX) between `n` agreements' threads, as a c10d group would do it."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=10)
        self.slots: list[torch.Tensor | None] = [None] * n
        self.calls = [0] * n

    def group(self, rank: int) -> Any:
        exchange = self

        class Group:
            def allreduce(self, tensors: list[torch.Tensor], op: Any) -> _Done:
                assert op == torch.distributed.ReduceOp.MAX
                exchange.calls[rank] += 1
                exchange.slots[rank] = tensors[0].clone()
                exchange.barrier.wait()
                result = torch.stack([t for t in exchange.slots if t is not None]).amax(0)
                exchange.barrier.wait()  # both read before either posts its next round
                tensors[0].copy_(result)
                return _Done()

        return Group()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _train(
    step_s: list[float], steps: int, requests: dict[int, list[int]]
) -> tuple[list[list[int]], list[SaveAgreement], list[int]]:
    """Ranks in lockstep, rank r's steps `step_s[r]` long; `requests[r]`: the step ends whose
    boundary delivers rank r a request. Returns each rank's saving step ends."""
    world = len(step_s)
    exchange = _Exchange(world)
    clocks = [_Clock() for _ in range(world)]
    agreements = [SaveAgreement(clock=clocks[r]) for r in range(world)]
    for rank, agreement in enumerate(agreements):
        agreement.start(exchange.group(rank))
    saves: list[list[int]] = [[] for _ in range(world)]
    for end in range(1, steps + 1):
        for rank, agreement in enumerate(agreements):
            clocks[rank].now += step_s[rank]
            for _ in range(requests.get(rank, []).count(end)):
                agreement.request()
            if agreement.save_now():
                saves[rank].append(end)
    for agreement in agreements:
        agreement.close()
    return saves, agreements, exchange.calls


def test_fast_steps_agree_every_few_steps_and_every_rank_saves_the_same_step_once() -> None:
    # 50 ms steps: rounds MAX_GAP_STEPS apart; rank 1 sees the request a step after rank 0.
    saves, agreements, calls = _train([0.05, 0.05], 40, {0: [13], 1: [14]})
    assert saves[0] == saves[1] and len(saves[0]) == 1
    assert 13 < saves[0][0] <= 13 + MAX_GAP_STEPS
    assert [a.gap for a in agreements] == [MAX_GAP_STEPS] * 2
    assert calls[0] == calls[1] == agreements[0].rounds <= 2 + 40 // MAX_GAP_STEPS


def test_steps_of_a_round_or_longer_agree_at_every_step_end_and_save_at_the_next() -> None:
    saves, agreements, calls = _train([2.0, 2.0], 12, {1: [5]})
    assert saves == [[6], [6]]
    assert calls == [12, 12] and [a.gap for a in agreements] == [1, 1]


def test_the_gap_is_the_smallest_rank_proposes_and_each_request_saves_once() -> None:
    # Rank 0 would round every 4 step ends, rank 1 (its steps twice as long) every 2 (at ROUND_S).
    step = save_agreement.ROUND_S / 2
    saves, agreements, _ = _train([step / 2, step], 30, {0: [7, 7, 20], 1: [8]})
    assert [a.gap for a in agreements] == [2, 2]
    # Two requests seen at one boundary: one save; a later one: another, all on both ranks.
    assert saves[0] == saves[1] and len(saves[0]) == 2
    assert 7 < saves[0][0] <= 9 and 20 < saves[0][1] <= 22


@pytest.mark.parametrize(
    ("step_s", "gap"),
    [(None, 1), (0.0, 1), (float("nan"), 1), (10.0, 1), (0.4, 2), (0.001, MAX_GAP_STEPS)],
)
def test_a_ranks_proposed_gap_fits_its_steps_in_a_round(step_s: float | None, gap: int) -> None:
    assert save_agreement.propose_gap(step_s) == gap


def test_a_failed_all_reduce_ends_saving_on_every_step_end_after_it() -> None:
    class Broken:
        def allreduce(self, tensors: list[torch.Tensor], op: Any) -> Any:
            raise RuntimeError("peer gone")

    agreement = SaveAgreement()
    agreement.start(Broken())
    agreement.request()
    assert agreement.save_now() is False  # the round is asked
    with pytest.raises(RuntimeError, match="checkpoint agreement failed"):
        agreement.save_now()
    assert [agreement.save_now(), agreement.save_now()] == [False, False]
    agreement.close()
