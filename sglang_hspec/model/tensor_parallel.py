"""Tensor parallelism for a loaded drafter: its attention sharded by KV head, as the target's KV cache is.

Under tensor parallelism rank r of `world_size` holds the target's KV heads [r*kv/tp, (r+1)*kv/tp), and
the drafter's attention reads that cache in place. So each attention layer keeps the query heads of its
rank's KV groups (query head h belongs to KV group h // (heads / kv_heads), the GQA rule of SDPA and of
the target), the matching rows of q_proj / k_proj / v_proj (the block's own keys and values are sharded
the same way) and o_proj's columns of those heads; o_proj's partial sums are then all-reduced. The rest of
the drafter (Mamba layers, MLPs, norms, state projection, heads) is small and stays replicated: every
rank runs it on the same inputs and proposes the same tokens.

Checkpoints stay unsharded: load the whole drafter, then `shard_drafter`. The all-reduce is passed in
(SGLang's `tensor_model_parallel_all_reduce` inside a server, `torch_all_reduce` on a torch.distributed
group elsewhere), so this module imports no serving framework.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sglang_hspec.model.hspec import Attention, DraftModel

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks, returns the sum


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> range:
    """The KV heads rank `rank` holds, as SGLang shards the target's (contiguous, kv/tp each). Refuses
    head counts that do not divide, naming both numbers."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if num_kv_heads % world_size:
        raise ValueError(f"the drafter's attention cannot be sharded over {world_size} ranks: the target has "
                         f"{num_kv_heads} KV heads, which {world_size} does not divide (each rank reads a whole "
                         f"number of KV heads of its cache); use a tensor-parallel size that divides {num_kv_heads}")
    per_rank = num_kv_heads // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def check_shardable(num_kv_heads: int, world_size: int) -> None:
    kv_head_range(num_kv_heads, 0, world_size)


def torch_all_reduce(group=None) -> AllReduce:
    """A sum over a torch.distributed process group (default: the world)."""
    import torch.distributed as dist

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return all_reduce


class RowParallelLinear(nn.Module):
    """o_proj's columns of this rank's heads: the partial sum over them, summed over the ranks. Holds
    `weight` under the same name as the nn.Linear it replaces."""

    def __init__(self, weight: torch.Tensor, all_reduce: AllReduce):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(F.linear(x, self.weight))


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    out = nn.Linear(linear.in_features, stop - start, bias=False, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    out.weight = nn.Parameter(linear.weight.detach()[start:stop].clone(), requires_grad=linear.weight.requires_grad)
    return out


@torch.no_grad()
def shard_attention(attn: Attention, rank: int, world_size: int, all_reduce: AllReduce) -> None:
    """Keep rank `rank`'s KV heads of one attention layer and the query heads of their groups (in place)."""
    kv = kv_head_range(attn.nkv, rank, world_size)
    group = attn.nh // attn.nkv
    heads = range(kv.start * group, kv.stop * group)
    hd = attn.hd
    attn.q_proj = _rows(attn.q_proj, heads.start * hd, heads.stop * hd)
    attn.k_proj = _rows(attn.k_proj, kv.start * hd, kv.stop * hd)
    attn.v_proj = _rows(attn.v_proj, kv.start * hd, kv.stop * hd)
    o = attn.o_proj.weight.detach()[:, heads.start * hd:heads.stop * hd].clone()
    o.requires_grad_(attn.o_proj.weight.requires_grad)
    attn.o_proj = RowParallelLinear(o, all_reduce)
    attn.nh, attn.nkv = len(heads), len(kv)


def shard_drafter(model: DraftModel, rank: int, world_size: int, all_reduce: AllReduce) -> DraftModel:
    """Shard a loaded drafter's attention layers for (rank, world_size), in place; returns the model.
    world_size 1 leaves it untouched."""
    if world_size == 1:
        return model
    check_shardable(model.config.target.num_key_value_heads, world_size)
    for module in model.modules():
        if isinstance(module, Attention):
            shard_attention(module, rank, world_size, all_reduce)
    model.tp_rank, model.tp_size = rank, world_size
    return model


def local_kv_heads(num_kv_heads: int, drafter: nn.Module) -> int:
    """KV heads per rank a drafter reads of a target with `num_kv_heads` (all of them when unsharded)."""
    return num_kv_heads // int(getattr(drafter, "tp_size", 1))


def shard_kv_heads(kv: torch.Tensor, rank: int, world_size: int, *, head_dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s KV heads of a full cache tensor (heads along `head_dim`), as its shard of a target
    cache holds them: for tests and tools that start from an unsharded cache."""
    heads = kv_head_range(kv.shape[head_dim], rank, world_size)
    return kv.narrow(head_dim, heads.start, len(heads))
