"""vigil's DDP comm hook averages exactly as DDP does without it, and where the backend only
sums (gloo) divides the reduced bucket on the comm thread, not on the training thread before
the all-reduce.

Two ranks run in two threads of this process, each with its own gloo process group over a
shared in-memory store: DDP's own (hookless) averaging and vigil's hook train the same model on
the same per-rank data, and must end with the same parameters.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from vigil.agent import ddp_hook

WORLD = 2
_GROUPS: list[Any] = []


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(
    rank: int, store: Any, model: torch.nn.Module, hooked: bool, out: dict[int, list[torch.Tensor]]
) -> None:
    group = _gloo_group(dist.PrefixStore(f"hooked={hooked}", store), rank)
    # Held past the thread: freeing the last reference to a gloo group (here, with the model at
    # the thread's end) joins gloo's threads while holding the GIL, which a gloo thread still
    # freeing its last work may wait for (torch's deadlock, not vigil's).
    _GROUPS.append(group)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=1)
    if hooked:
        ddp.register_comm_hook(group, ddp_hook.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=data)).square().mean().backward()
        opt.step()
    out[rank] = [p.detach().clone() for p in model.parameters()]


def _gloo_group(store: Any, rank: int) -> Any:
    """A gloo process group of this thread's own, not registered with `torch.distributed`."""
    group = dist.ProcessGroup(store, rank, WORLD)
    gloo = dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(gloo)
    group._register_backend(torch.device("cpu"), gloo, dist.ProcessGroupGloo(store, rank, WORLD))
    return group


def _run(hooked: bool) -> dict[int, list[torch.Tensor]]:
    store = dist.HashStore()
    out: dict[int, list[torch.Tensor]] = {}
    threads = [
        threading.Thread(target=_train, args=(rank, store, _model(), hooked, out))
        for rank in range(WORLD)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(out) == list(range(WORLD)), "a rank did not finish"
    return out


def test_the_hook_averages_gradients_as_ddp_does_without_it() -> None:
    plain, hooked = _run(hooked=False), _run(hooked=True)
    for rank in range(WORLD):
        for p, q in zip(plain[rank], hooked[rank], strict=True):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    # the ranks saw different data, so an unaveraged (or twice-divided) sum would differ
    assert not torch.equal(plain[0][0], _run_single_rank_reference())


def _run_single_rank_reference() -> torch.Tensor:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=data)).square().mean().backward()
        opt.step()
    return next(model.parameters()).detach()


class _Bucket:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self.tensor


class _SummingGroup:
    """A 4-member group whose all-reduce completes only when the test says so (as gloo's comm
    thread would), summing four equal contributions."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self.tensor: torch.Tensor | None = None

    def size(self) -> int:
        return 4

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> Any:
        assert options.reduceOp == dist.ReduceOp.SUM
        self.tensor = tensors[0]
        future = self.future

        class _Work:
            def get_future(self) -> Any:
                return future

        return _Work()

    def complete(self) -> None:
        assert self.tensor is not None
        self.tensor.mul_(4)  # the sum of four ranks' equal buckets
        self.future.set_result([self.tensor])


@pytest.mark.parametrize(
    ("dtype", "divided_before"), [(torch.float32, False), (torch.float16, True)]
)
def test_a_summed_bucket_is_divided_in_the_completion_callback_except_float16(
    dtype: torch.dtype, divided_before: bool
) -> None:
    group, tensor = _SummingGroup(), torch.full((64,), 2.0, dtype=dtype)
    fut = ddp_hook.ddp_comm_hook(group, _Bucket(tensor))
    # what the training thread did before the all-reduce: nothing but float16's pre-division
    assert torch.equal(tensor, torch.full((64,), 0.5 if divided_before else 2.0, dtype=dtype))
    assert not fut.done()
    group.complete()
    assert fut.value() is tensor
    assert torch.equal(tensor, torch.full((64,), 2.0, dtype=dtype))  # the average of four 2.0s
