"""The whole drafter: block-parallel forward == step-by-step evaluation; propose == training forward."""

import math

import pytest
import torch
import torch.nn.functional as F

from sglang_hspec.core.types import DraftContext, SamplingParams
from sglang_hspec.target.kv_view import dense_window_view

from ._tiny import make_drafter, make_target, target_features


@pytest.fixture(scope="module")
def setup():
    target = make_target("qwen3")
    ids = torch.randint(4, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    return target, ids, target_features(target, ids)


def mamba_sequential(m, u, s0):
    """Mamba-2 mixer one token at a time: conv window shift register + SSM recurrence."""
    N, L, _ = u.shape
    z, xbc, dt = torch.split(m.in_proj(u), [m.d_inner, m.conv_dim, m.nheads], dim=-1)
    w, bias = m.conv1d.weight[:, 0, :], m.conv1d.bias
    window = u.new_zeros(N, m.conv_dim, w.shape[1])
    A = -torch.exp(m.A_log)
    state, outs = s0, []
    for t in range(L):
        window = torch.cat([window[:, :, 1:], xbc[:, t, :, None]], dim=2)
        c = F.silu((window * w).sum(-1) + bias)
        x, B, C = torch.split(c, [m.d_inner, m.ngroups * m.dstate, m.ngroups * m.dstate], dim=-1)
        x = x.view(N, m.nheads, m.headdim)
        rep = m.nheads // m.ngroups
        B = B.view(N, m.ngroups, m.dstate).repeat_interleave(rep, 1)
        C = C.view(N, m.ngroups, m.dstate).repeat_interleave(rep, 1)
        dtt = F.softplus(dt[:, t] + m.dt_bias)
        state = torch.exp(dtt * A)[..., None, None] * state + dtt[..., None, None] * x[..., None] * B[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", state, C) + m.D[:, None] * x
        outs.append(m.gated_norm_out(y.view(N, 1, m.nheads, m.headdim), z[:, t:t + 1]))
    return torch.cat(outs, dim=1)


def attn_sequential(a, x, positions, inv_freq, ctx):
    """One query at a time with an explicit softmax (no SDPA, no combined mask)."""
    from sglang_hspec.model.hspec import apply_rope

    N, L, _ = x.shape
    q = a.q_proj(x).view(N, L, a.nh, a.hd)
    if a.q_norm is not None:
        q = a.q_norm(q)
    q = apply_rope(q.transpose(1, 2), positions, inv_freq)
    k, v = a.project_kv(x, positions, inv_freq)
    outs = []
    for j in range(L):
        last = j + 1 if a.causal else L
        kk, vv = k[:, :, :last], v[:, :, :last]
        valid = torch.ones(N, last, dtype=torch.bool)
        if ctx is not None:
            kk, vv = torch.cat([ctx.key, kk], 2), torch.cat([ctx.value, vv], 2)
            valid = torch.cat([ctx.mask, valid], 1)
        kk, vv = kk.repeat_interleave(a.nh // a.nkv, 1), vv.repeat_interleave(a.nh // a.nkv, 1)
        scores = (q[:, :, j:j + 1] @ kk.transpose(-1, -2)) / math.sqrt(a.hd)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        outs.append(torch.softmax(scores, -1) @ vv)
    out = torch.cat(outs, dim=2).transpose(1, 2).reshape(N, L, -1)
    return a.o_proj(out)


def sequential_backbone(model, anchor, n, hidden_last, contexts):
    k = model.block_size
    ids = torch.full((anchor.shape[0], k), model.config.mask_token_id)
    ids[:, 0] = anchor
    x = model.embed(ids)
    positions = n[:, None] + 1 + torch.arange(k)
    s0 = model.initial_state(hidden_last, anchor.shape[0], x) if model.config.uses_mamba else None
    i = 0
    for layer in model.layers:
        if layer.mamba is not None:
            x = x + mamba_sequential(layer.mamba, layer.mamba_norm(x), s0)
        if layer.attn is not None:
            x = x + attn_sequential(layer.attn, layer.attn_norm(x), positions, model.inv_freq, contexts.get(i))
            i += 1
        x = x + layer.mlp(layer.mlp_norm(x))
    return model.norm(x)


def context_for(model, feats, n):
    hidden_last = feats.hidden[torch.arange(n.shape[0]), n] if model.target_layer_ids else None
    views = {lid: dense_window_view(*feats.kv[lid], n, model.sliding_window) for lid in model.kv_layer_ids}
    return hidden_last, views


@pytest.mark.parametrize("kind", ["hspec", "hspec_kv_only", "hspec_last_token_only", "dflash_target_kv"])
def test_block_forward_equals_sequential(setup, kind):
    target, ids, feats = setup
    model = make_drafter(kind, target, sliding_window=8)
    n = torch.tensor([5, 16])
    anchor = ids[torch.arange(2), n + 1]
    hidden_last, views = context_for(model, feats, n)
    ctx = DraftContext(anchor_tokens=anchor, last_position=n, target_hidden=hidden_last, kv_views=views)
    with torch.no_grad():
        contexts = model.propose_contexts(ctx)
        par = model.backbone(anchor, n, hidden_last, contexts)
        seq = sequential_backbone(model, anchor, n, hidden_last, contexts)
    assert par.abs().max() > 0.1
    assert (par - seq).abs().max() < 1e-10


def test_mamba_state_injection_reaches_output(setup):
    target, ids, feats = setup
    model = make_drafter("hspec", target)
    n = torch.tensor([7, 7])
    anchor = ids[:, 8]
    hidden_last, views = context_for(model, feats, n)
    contexts = model.propose_contexts(DraftContext(anchor, n, hidden_last, views))
    with torch.no_grad():
        a = model.backbone(anchor, n, hidden_last, contexts)
        noise = torch.randn(hidden_last.shape, generator=torch.Generator().manual_seed(5), dtype=hidden_last.dtype)
        b = model.backbone(anchor, n, hidden_last + noise, contexts)
        c = model.backbone(anchor, n, hidden_last * 1.5, contexts)  # per-layer RMSNorm: scale-free
    assert (a - c).abs().max() < 1e-6
    assert (a - b).abs().amax(dim=(0, 2)).min() > 1e-4  # every slot feels the injected state


@pytest.mark.parametrize("kind", ["hspec", "dspark", "hspec_last_token_only"])
def test_greedy_propose_matches_teacher_forced_training_forward(setup, kind):
    """propose (sequential Markov sampling) and forward_train (teacher-forced) share the block code:
    teacher-forcing the proposed tokens reproduces them as argmaxes and the same confidences."""
    target, ids, feats = setup
    model = make_drafter(kind, target, sliding_window=6)
    n = torch.tensor([9, 12])
    anchors = n + 1
    hidden_last, views = context_for(model, feats, n)
    ctx = DraftContext(ids[torch.arange(2), anchors], n, hidden_last, views)
    if kind == "dspark":  # its drafter KV cache is fed every committed position (here: a prefill)
        ctx.row_ids, ctx.new_hidden, ctx.new_hidden_lengths = torch.arange(2), feats.hidden[:, :13], n + 1
    prop = model.propose(ctx, SamplingParams())
    assert prop.q is None
    teacher = ids.clone()
    for b in range(2):  # the drafted block becomes the "sequence" after the anchor
        teacher[b, anchors[b] + 1: anchors[b] + 1 + model.block_size] = prop.tokens[b]
    out = model.forward_train(feats, teacher, anchors[:, None])
    assert out.logits.shape == (2, 1, model.block_size, 100)
    assert torch.equal(model.d2t[out.logits[:, 0].argmax(-1)], prop.tokens)
    torch.testing.assert_close(out.confidence_logits[:, 0], prop.confidence_logits, rtol=1e-6, atol=1e-6)


def test_sampled_q_is_over_target_vocab_and_zero_outside_draft_vocab(setup):
    target, ids, feats = setup
    model = make_drafter("hspec", target)
    d2t = torch.randperm(128, generator=torch.Generator().manual_seed(3))[:100].sort().values
    model.set_draft_vocab(d2t)
    n = torch.tensor([10, 20])
    hidden_last, views = context_for(model, feats, n)
    ctx = DraftContext(ids[torch.arange(2), n + 1], n, hidden_last, views)
    params = SamplingParams(temperature=0.7, top_k=20)
    prop = model.propose(ctx, params, torch.Generator().manual_seed(0))
    assert prop.q.shape == (2, 7, 128)
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(2, 7))
    outside = torch.ones(128, dtype=torch.bool)
    outside[d2t] = False
    assert prop.q[..., outside].abs().max() == 0
    assert ((prop.q > 0).sum(-1) <= 20).all()
    assert prop.q.gather(-1, prop.tokens[..., None]).min() > 0  # every drafted token has q > 0
    again = model.propose(ctx, params, torch.Generator().manual_seed(0))
    assert torch.equal(again.tokens, prop.tokens)


def test_training_forward_batches_many_anchors(setup):
    """One call over A anchors equals A separate calls."""
    target, ids, feats = setup
    model = make_drafter("hspec", target, sliding_window=5)
    anchors = torch.tensor([[1, 4, 9, 20], [2, 3, 15, 22]])
    out = model.forward_train(feats, ids, anchors)
    for a in range(anchors.shape[1]):
        single = model.forward_train(feats, ids, anchors[:, a:a + 1])
        torch.testing.assert_close(out.logits[:, a], single.logits[:, 0], rtol=1e-10, atol=1e-10)
    tgt, draft = model.block_labels(ids, anchors)
    assert tgt[0, 3].tolist() == ids[0, 21:24].tolist() + [-100] * 4
    assert (draft[tgt == -100] == -100).all()


def test_gradients_reach_state_projection_and_not_target(setup):
    target, ids, feats = setup
    model = make_drafter("hspec", target).train()
    out = model.forward_train(feats, ids, torch.tensor([[3, 8], [5, 11]]))
    _, labels = model.block_labels(ids, torch.tensor([[3, 8], [5, 11]]))
    loss = F.cross_entropy(out.logits.flatten(0, 2), labels.flatten(), ignore_index=-100)
    loss = loss + out.confidence_logits.sum()
    loss.backward()
    assert model.state_proj.fuse.weight.grad.abs().sum() > 0
    assert model.layers[0].mamba.A_log.grad.abs().sum() > 0
    assert target.lm_head.weight.grad is None and target.model.embed_tokens.weight.grad is None
    names = {n for n, _ in model.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
