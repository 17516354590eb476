"""H-Spec owns no per-request buffer that grows with context; dflash's drafter KV grows linearly."""

import dataclasses

import torch

from sglang_hspec.core.types import DraftContext, SamplingParams
from sglang_hspec.target.kv_view import dense_window_view

from ._tiny import make_drafter, make_target


def owned_bytes(model) -> int:
    """Every tensor reachable from the drafter's modules (parameters, buffers, caches, state objects),
    excluding the shared target embedding / LM head."""
    seen, total = set(), 0

    def visit(obj):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if obj.data_ptr() not in seen:
                seen.add(obj.data_ptr())
                total += obj.numel() * obj.element_size()
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                visit(o)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name))

    for mod in model.modules():
        for name, value in vars(mod).items():
            if name != "_target":
                visit(value)
    return total


def _propose(model, T, hidden_all):
    """One propose at context T; the whole context arrives as new hidden rows (a prefill)."""
    n = torch.tensor([T - 1])
    g = torch.Generator().manual_seed(0)
    kv, D = model.config.target.num_key_value_heads, model.config.target.head_dim
    K = torch.randn(1, kv, T, D, generator=g, dtype=torch.float64)
    ctx = DraftContext(torch.tensor([5]), n, hidden_all[:, T - 1],
                       {lid: dense_window_view(K, K, n, model.sliding_window) for lid in model.kv_layer_ids},
                       row_ids=torch.tensor([0]), new_hidden=hidden_all[:, :T], new_hidden_lengths=torch.tensor([T]))
    model.propose(ctx, SamplingParams())


def test_hspec_owned_bytes_do_not_depend_on_context():
    target = make_target("qwen3")
    model = make_drafter("hspec", target)
    hidden = torch.randn(1, 4096, 5, 64, dtype=torch.float64)
    _propose(model, 64, hidden)
    at_64 = owned_bytes(model)
    _propose(model, 4096, hidden)
    assert owned_bytes(model) == at_64
    assert model.owned_state_bytes() == 0


def test_dflash_drafter_kv_grows_linearly():
    target = make_target("qwen3")
    per_token = 5 * 2 * 2 * 16 * 8  # layers x (K, V) x kv_heads x head_dim x float64 bytes
    hidden = torch.randn(1, 4096, 5, 64, dtype=torch.float64)
    for kind in ("dflash", "dspark"):
        model = make_drafter(kind, target)
        sizes = {}
        for T in (64, 4096):
            model.reset()
            _propose(model, T, hidden)
            sizes[T] = owned_bytes(model)
            assert model.owned_state_bytes() == T * per_token
        assert sizes[4096] - sizes[64] == (4096 - 64) * per_token
        model.reset()
        assert model.owned_state_bytes() == 0
