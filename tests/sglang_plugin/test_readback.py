"""readback.AsyncSums on CPU tensors (ready at once, in push order, bounded); the device path (pinned buffers
behind events, no host sync) is checked on a GPU by scripts/gpu_check.py (`readback_no_sync`)."""

import pytest
import torch

from sglang_hspec.sglang_plugin.readback import AsyncSums


def test_cpu_sums_are_ready_at_once_in_push_order():
    sums = AsyncSums(capacity=4)
    assert sums.ready() == []
    sums.push("a", torch.tensor([1, 2, 3], dtype=torch.int32))
    sums.push("b", torch.tensor([4], dtype=torch.int32))
    assert sums.ready() == [("a", 6), ("b", 4)]
    assert sums.ready() == []


def test_more_than_capacity_drops_the_oldest():
    sums = AsyncSums(capacity=2)
    for key, n in (("a", 1), ("b", 2), ("c", 3)):
        sums.push(key, torch.ones(n, dtype=torch.int32))
    assert sums.ready() == [("b", 2), ("c", 3)]
    with pytest.raises(ValueError, match="capacity"):
        AsyncSums(capacity=0)
