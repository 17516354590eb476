"""The draft forward is CUDA-graph safe by construction: `propose` and the training forward run on the
meta device under `forbid_host_sync` (no host read, no host-to-device copy, every tensor on the model's
device), and moving the model keeps the RoPE frequencies exact (float64, never rounded by a dtype cast)."""

import pytest
import torch

from sglang_hspec.core.types import DraftContext, SamplingParams
from sglang_hspec.model.hspec import rope_inv_freq
from sglang_hspec.target.kv_view import TargetKVView

from ._graph_guard import HostSyncError, forbid_host_sync
from ._tiny import make_drafter, make_target


def test_guard_catches_host_reads_and_host_tensors():
    x = torch.ones(3, device="meta")
    with pytest.raises(HostSyncError, match="_local_scalar_dense"), forbid_host_sync():
        x.sum().item()
    with pytest.raises(HostSyncError, match="host tensors"), forbid_host_sync():
        x * torch.arange(3.0)
    with pytest.raises(HostSyncError, match="nonzero"), forbid_host_sync():
        x.nonzero()
    with forbid_host_sync():  # device-side work passes
        (x * 2 + torch.arange(3, device="meta")).softmax(-1)


def _to_meta(model):
    model = model.to("meta")
    embed, lm = model._target
    model._target = (embed.to("meta"), lm.to("meta"))  # shared target modules are not children
    return model


def _meta_context(drafter, B=3, W=16, T=40):
    t = drafter.config.target
    views = {}
    for layer_id in set(drafter.kv_layer_ids):
        views[layer_id] = TargetKVView(
            key=torch.empty(B, t.num_key_value_heads, T, t.head_dim, device="meta"),
            value=torch.empty(B, t.num_key_value_heads, T, t.head_dim, device="meta"),
            token_index=torch.empty(B, W, dtype=torch.long, device="meta"),
            positions=torch.empty(B, W, dtype=torch.long, device="meta"),
            valid=torch.empty(B, W, dtype=torch.bool, device="meta"),
            row_index=torch.empty(B, dtype=torch.long, device="meta"))
    hidden = torch.empty(B, len(drafter.target_layer_ids), t.hidden_size, device="meta")
    return DraftContext(anchor_tokens=torch.empty(B, dtype=torch.long, device="meta"),
                        last_position=torch.empty(B, dtype=torch.long, device="meta"),
                        target_hidden=hidden, kv_views=views)


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", dtype=torch.float32)


@pytest.mark.parametrize("kind", ["hspec", "hspec_kv_only", "hspec_last_token_only"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=20)],
                         ids=["greedy", "sampled"])
def test_propose_has_no_host_sync_or_host_tensor(target, kind, sampling):
    drafter = _to_meta(make_drafter(kind, target))
    ctx = _meta_context(drafter)
    with forbid_host_sync():
        prop = drafter.propose(ctx, sampling)
    assert prop.tokens.shape == (3, drafter.block_size) and prop.tokens.device.type == "meta"


def test_training_forward_has_no_host_sync_or_host_tensor(target):
    drafter = _to_meta(make_drafter("hspec", target))
    ctx = _meta_context(drafter)
    h = drafter.backbone(ctx.anchor_tokens, ctx.last_position, ctx.target_hidden, {})  # warm the LM-head cache
    with forbid_host_sync():
        h = drafter.backbone(ctx.anchor_tokens, ctx.last_position, ctx.target_hidden,
                             drafter.propose_contexts(ctx))
        out = drafter.head_outputs(h, ctx.anchor_tokens[:, None].expand(-1, drafter.block_size))
    assert out.logits.shape == (3, drafter.block_size, drafter.config.draft_vocab_size)


def test_rope_frequencies_follow_the_device_and_stay_float64(target):
    drafter = make_drafter("hspec", target)
    t = drafter.config.target
    exact = rope_inv_freq(t.head_dim, t.rope_theta, t.rope_scaling)
    assert "inv_freq" in dict(drafter.named_buffers()) and "inv_freq" not in drafter.state_dict()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(), lambda m: m.double()):
        cast(drafter)
        assert drafter.inv_freq.dtype == torch.float64 and torch.equal(drafter.inv_freq, exact)
    drafter.to("meta")
    assert drafter.inv_freq.device.type == "meta" and drafter.inv_freq.dtype == torch.float64
    drafter.to_empty(device="cpu")  # e.g. a model built on meta, then materialised: recomputed, not garbage
    assert torch.equal(drafter.inv_freq, exact)
