"""Attention over the target's KV, read in place with continued RoPE positions."""

import pytest
import torch

from sglang_hspec.core.types import DraftContext
from sglang_hspec.model.hspec import apply_rope, gather_window
from sglang_hspec.target.kv_view import TargetKVView, dense_window_view

from ._tiny import make_drafter, make_target, target_features


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_drafter_attention_with_target_weights_reproduces_target_attention(arch):
    """With target layer L's attention weights, block queries at n+1..n+k over the target's cached
    K/V of 0..n plus the block's own keys give exactly the target's attention output there: same
    RoPE, positions, GQA and QK-norm as the stored keys."""
    target = make_target(arch)
    ids = torch.randint(4, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    L = 3
    captured = {}
    layer = target.model.layers[L]
    h1 = layer.input_layernorm.register_forward_hook(lambda m, i, o: captured.__setitem__("x", o))
    h2 = layer.self_attn.register_forward_hook(lambda m, i, o: captured.__setitem__("y", o[0]))
    feats = target_features(target, ids)
    h1.remove()
    h2.remove()
    model = make_drafter("hspec", target)
    attn = model.layers[0].attn
    src = layer.self_attn
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name).weight.copy_(getattr(src, name).weight)
        if arch == "qwen3":
            attn.q_norm.weight.copy_(src.q_norm.weight)
            attn.k_norm.weight.copy_(src.k_norm.weight)
    n = torch.tensor([8, 12])
    k = model.block_size
    pos = n[:, None] + 1 + torch.arange(k)
    rows = torch.arange(2)[:, None]
    ctx = gather_window(dense_window_view(*feats.kv[L], n, 2048), n, 2048)
    with torch.no_grad():
        out = attn(captured["x"][rows, pos], pos, model.inv_freq, ctx)
    # HF rotates in float32 (cos/sin of float32 angles) even for a float64 model; ours uses float64 angles
    torch.testing.assert_close(out, captured["y"][rows, pos], rtol=1e-5, atol=2e-6)
    with torch.no_grad():
        off = attn(captured["x"][rows, pos], pos + 1, model.inv_freq, ctx)
    assert (off - captured["y"][rows, pos]).abs().max() > 1e-3


def _synthetic(model, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv, D = model.config.target.num_key_value_heads, model.config.target.head_dim
    raw_k = torch.randn(1, kv, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, kv, T, D, generator=g, dtype=torch.float64)
    hidden = torch.randn(1, 5, model.config.hidden_size, generator=g, dtype=torch.float64)
    return raw_k, v, hidden


def _run(model, keys, values, positions, n, hidden, anchor=7):
    """Drafter output with every layer reading the same K/V storage at the given absolute positions."""
    T = keys.shape[2]
    view = TargetKVView(key=keys, value=values, token_index=torch.arange(T)[None], positions=positions[None],
                        valid=torch.ones(1, T, dtype=torch.bool), row_index=torch.tensor([0]))
    ctx = DraftContext(torch.tensor([anchor]), torch.tensor([n]), hidden, {lid: view for lid in model.kv_layer_ids})
    with torch.no_grad():
        return model.backbone(ctx.anchor_tokens, ctx.last_position, hidden, model.propose_contexts(ctx))


@pytest.fixture(scope="module")
def model():
    return make_drafter("hspec", make_target("qwen3"), sliding_window=2048)


def test_shifting_all_positions_is_invariant_and_off_by_one_is_not(model):
    raw_k, v, hidden = _synthetic(model)
    T = raw_k.shape[2]
    p = torch.arange(T)
    base = _run(model, apply_rope(raw_k, p[None], model.inv_freq), v, p, T - 1, hidden)
    c = 1000
    shifted = _run(model, apply_rope(raw_k, (p + c)[None], model.inv_freq), v, p + c, T - 1 + c, hidden)
    assert (shifted - base).abs().max() < 1e-9
    # keys stored at p but the drafter told the context ends one later: queries rotate off by one
    off = _run(model, apply_rope(raw_k, p[None], model.inv_freq), v, p + 1, T, hidden)
    assert (off - base).abs().max() > 1e-3


def test_keys_older_than_the_window_are_not_attended():
    target = make_target("qwen3")
    model = make_drafter("hspec", target, sliding_window=6)
    raw_k, v, hidden = _synthetic(model)
    T = raw_k.shape[2]
    p = torch.arange(T)
    keys = apply_rope(raw_k, p[None], model.inv_freq)
    n = T - 1
    base = _run(model, keys, v, p, n, hidden)  # the view covers all T positions: the model masks
    k2, v2 = keys.clone(), v.clone()
    oldest_kept = n + 1 - 6
    k2[:, :, :oldest_kept] += 5.0
    v2[:, :, :oldest_kept] += 5.0
    assert (_run(model, k2, v2, p, n, hidden) - base).abs().max() == 0
    v3 = v.clone()
    v3[:, :, oldest_kept] += 5.0
    assert (_run(model, keys, v3, p, n, hidden) - base).abs().max() > 1e-3


def test_outputs_ignore_target_tokens_after_n():
    """Block slot j depends on positions <= n (KV, hidden) and the teacher tokens up to anchor+j only."""
    target = make_target("qwen3")
    model = make_drafter("hspec", target, sliding_window=2048)
    ids = torch.randint(4, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    a = 12  # anchor position; n = 11
    changed = ids.clone()
    changed[0, a + 3:] = torch.randint(4, 128, (30 - a - 3,), generator=torch.Generator().manual_seed(3))
    out1 = model.forward_train(target_features(target, ids), ids, torch.tensor([[a]]))
    out2 = model.forward_train(target_features(target, changed), changed, torch.tensor([[a]]))
    # slots 0..2 use previous tokens at a..a+2 (unchanged); slot 3's Markov bias sees position a+3
    assert (out1.logits[0, 0, :3] - out2.logits[0, 0, :3]).abs().max() < 1e-10
    assert (out1.logits[0, 0, 3] - out2.logits[0, 0, 3]).abs().max() > 1e-3
    # the target's KV beyond n is really different in storage: the view must not read it
    f1, f2 = target_features(target, ids), target_features(target, changed)
    assert (f1.kv[5][0][:, :, a + 3:] - f2.kv[5][0][:, :, a + 3:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind,arch", [("hspec", "qwen3"), ("hspec", "llama"), ("dflash", "qwen3")])
def test_sequence_attention_equals_per_block_windows_with_gradients(kind, arch):
    """Training reads each sequence's KV in place for all its blocks (`sequence_block_attention`, blocks
    padded per sequence, context and block keys sharing one softmax); the reference twin copies one
    window per block and runs SDPA. Same logits, confidences and parameter gradients (float64), with a
    window shorter than the context, GQA, and sequences holding different numbers of valid blocks."""
    target = make_target(arch)
    ids = torch.randint(4, 128, (3, 26), generator=torch.Generator().manual_seed(4))
    feats = target_features(target, ids)
    model = make_drafter(kind, target, sliding_window=6).train()
    anchors = torch.tensor([[1, 7, 12, 20], [2, 3, 9, 24], [5, 6, 18, 19]])
    valid = torch.tensor([[True, True, True, True], [False, True, False, False], [True, False, True, True]])
    results = []
    for gather in (True, False):
        model.zero_grad()
        out = model.forward_train(feats, ids, anchors, anchor_valid=valid, gather_windows=gather)
        weights = torch.linspace(-1, 1, out.logits.numel(), dtype=out.logits.dtype).view_as(out.logits)
        conf = out.confidence_logits
        ((out.logits * weights).sum() + (0 if conf is None else conf.pow(2).sum())).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), None if conf is None else conf.detach(), grads))
    (ref_logits, ref_conf, ref_grads), (logits, conf, grads) = results
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)  # the heads compute in float32
    torch.testing.assert_close(conf, ref_conf, rtol=1e-6, atol=1e-6)
    assert set(grads) == set(ref_grads) and any(n.endswith("q_proj.weight") for n in grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7 * g.abs().max().item() + 1e-12, msg=name)
    assert logits[1, 0].abs().max() == 0 and logits[1, 1].abs().max() > 0  # invalid blocks stay 0
