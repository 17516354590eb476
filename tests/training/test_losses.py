import math

import pytest
import torch

from sglang_hspec.training.losses import (
    block_loss,
    lm_head_log_partition,
    per_slot_terms,
    position_weights,
    sample_anchors,
    slot_mask,
    target_draft_probs,
    valid_anchor_mask,
)


def _hand_case():
    # target vocab 3, draft vocab {0, 2}; one sequence, one anchor at a=1, block of 3
    input_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1]])
    target_logits = torch.zeros(1, 6, 3)
    target_logits[0, 1] = torch.log(torch.tensor([2.0, 1.0, 1.0]))  # p_t = [.5, .25, .25]; pos 2: uniform
    draft_logits = torch.zeros(1, 1, 3, 2)
    draft_logits[0, 0, 0] = torch.tensor([0.0, math.log(3.0)])  # p_d = [.25, .75] -> full [.25, 0, .75]
    conf = torch.tensor([[[0.0, math.log(2.0), 5.0]]])  # sigmoid: 1/2, 2/3, ~1
    anchors = torch.tensor([[1]])
    mask = slot_mask(anchors=anchors, anchor_valid=torch.tensor([[True]]), loss_mask=loss_mask,
                     lengths=torch.tensor([6]), block_size=3)
    return dict(draft_logits=draft_logits, confidence_logits=conf, target_logits=target_logits,
                input_ids=input_ids, anchors=anchors, mask=mask, d2t=torch.tensor([0, 2]))


def test_block_loss_matches_hand_computed_terms():
    case = _hand_case()
    assert case["mask"].tolist() == [[[True, True, False]]]  # label position 4 is outside the loss mask
    out = block_loss(**case, gamma_decay=4.0)
    # slot 0: label id 2 (draft id 1), TV = .5(|.25-.5| + |0-.25| + |.75-.25|) = .5, conf label .5
    ce0, tv0, bce0 = -math.log(0.75), 0.5, math.log(2.0)
    # slot 1: label id 0 (draft id 0), p_d full [.5, 0, .5] vs uniform: TV = .5(1/6 + 1/3 + 1/6) = 1/3
    ce1, tv1 = math.log(2.0), 1.0 / 3.0
    bce1 = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))  # sigmoid(ln 2) = 2/3 = label 1 - TV
    w1 = math.exp(-0.25)
    expected = (0.1 * ce0 + 0.9 * tv0 + bce0) + w1 * (0.1 * ce1 + 0.9 * tv1 + bce1)
    assert out.loss_sum.item() == pytest.approx(expected, rel=1e-6)
    assert out.weight_sum.item() == pytest.approx(1 + w1, rel=1e-6)
    assert out.ce_sum.item() == pytest.approx(ce0 + w1 * ce1, rel=1e-6)
    assert out.tv_sum.item() == pytest.approx(tv0 + w1 * tv1, rel=1e-6)
    assert out.bce_sum.item() == pytest.approx(bce0 + w1 * bce1, rel=1e-6)
    # tau_prob = 1 + .5 + .5 * 2/3 (the masked third slot counts as a rejection)
    assert out.tau_sum.item() == pytest.approx(1 + 0.5 + 0.5 * 2 / 3, rel=1e-6)
    assert out.num_anchors.item() == 1
    assert out.accept_sum.tolist() == pytest.approx([0.5, 2 / 3, 0.0], rel=1e-6)
    assert out.accept_count.tolist() == [1.0, 1.0, 0.0]


def test_label_outside_draft_vocab_has_no_ce_but_full_tv():
    ce, tv = per_slot_terms(draft_logits=torch.zeros(1, 2), target_logits=torch.zeros(1, 3),
                            label_index=torch.tensor([0]), labels=torch.tensor([1]), d2t=torch.tensor([0, 2]))
    assert ce.item() == 0.0
    # p_d full [.5, 0, .5] vs uniform target: TV = 1/3
    assert tv.item() == pytest.approx(1 / 3, rel=1e-6)


def test_confidence_label_is_detached():
    grads = []
    for conf_weight in (0.0, 1.0):
        case = _hand_case()
        case["draft_logits"].requires_grad_(True)
        block_loss(**case, conf_weight=conf_weight).loss_sum.backward()
        grads.append(case["draft_logits"].grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_position_weights():
    w = position_weights(block_size=3, gamma_decay=4.0)
    assert w.tolist() == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5)], rel=1e-6)


def test_chunked_terms_equal_unchunked_with_gradients():
    g = torch.Generator().manual_seed(0)
    dl = torch.randn(13, 7, generator=g)
    tl = torch.randn(5, 11, generator=g)
    idx = torch.randint(0, 5, (13,), generator=g)
    lab = torch.randint(0, 11, (13,), generator=g)
    d2t = torch.tensor([0, 2, 3, 5, 7, 8, 10])
    outs = []
    for chunk in (1, 4, 100):
        x = dl.clone().requires_grad_(True)
        ce, tv = per_slot_terms(draft_logits=x, target_logits=tl, label_index=idx, labels=lab, d2t=d2t, chunk_rows=chunk)
        (ce.sum() + 2 * tv.sum()).backward()
        outs.append((ce.detach(), tv.detach(), x.grad))
    for o in outs[:2]:
        for a, b in zip(o, outs[2]):
            torch.testing.assert_close(a, b)


def test_anchors_stay_inside_loss_mask_and_sequence():
    g = torch.Generator().manual_seed(1)
    B, T, A, k = 6, 40, 8, 4
    loss_mask = (torch.rand(B, T, generator=g) > 0.4).long()
    lengths = torch.randint(5, T + 1, (B,), generator=g)
    anchors, ok = sample_anchors(loss_mask=loss_mask, lengths=lengths, num_anchors=A, seeds=list(range(B)))
    valid = valid_anchor_mask(loss_mask=loss_mask, lengths=lengths)
    for b in range(B):
        got = anchors[b][ok[b]].tolist()
        assert len(set(got)) == len(got) == min(A, int(valid[b].sum()))
        for a in got:
            assert a >= 1 and a + 1 < lengths[b] and loss_mask[b, a + 1] == 1
    mask = slot_mask(anchors=anchors, anchor_valid=ok, loss_mask=loss_mask, lengths=lengths, block_size=k)
    pos = anchors[..., None] + 1 + torch.arange(k)
    assert (pos[mask] < lengths[:, None, None].expand_as(pos)[mask]).all()
    rows = torch.arange(B)[:, None, None].expand_as(pos)
    assert (loss_mask[rows[mask], pos[mask]] == 1).all()
    assert (mask[..., 0] == ok).all()
    # prefix-closed: once a slot is masked, every later slot is
    assert (mask[..., 1:] <= mask[..., :-1]).all()
    # same seeds, same anchors (whatever micro-batch the sequence lands in)
    again, _ = sample_anchors(loss_mask=loss_mask[2:3], lengths=lengths[2:3], num_anchors=A, seeds=[2])
    assert again.tolist() == anchors[2:3].tolist()


def _random_block_case(seed=0, B=2, T=12, A=5, k=3, V=11, d=6):
    g = torch.Generator().manual_seed(seed)
    d2t = torch.tensor([0, 2, 3, 5, 7, 8])
    input_ids = torch.randint(0, V, (B, T), generator=g)
    loss_mask = (torch.rand(B, T, generator=g) > 0.3).long()
    lengths = torch.tensor([T, T - 4])
    anchors, ok = sample_anchors(loss_mask=loss_mask, lengths=lengths, num_anchors=A, seeds=[seed, seed + 1])
    mask = slot_mask(anchors=anchors, anchor_valid=ok, loss_mask=loss_mask, lengths=lengths, block_size=k)
    hidden = torch.randn(B, T, d, generator=g)
    lm_w, lm_b = torch.randn(V, d, generator=g), torch.randn(V, generator=g)
    draft_logits = torch.randn(B, A, k, d2t.numel(), generator=g)
    conf = torch.randn(B, A, k, generator=g)
    return dict(input_ids=input_ids, anchors=anchors, mask=mask, d2t=d2t, draft_logits=draft_logits,
                confidence_logits=conf), hidden, lm_w, lm_b, ok


def test_target_probs_from_hidden_equal_softmax_of_the_logits_restricted_to_the_draft_vocab():
    case, hidden, lm_w, lm_b, _ = _random_block_case()
    logits = torch.nn.functional.linear(hidden, lm_w, lm_b)
    p_full = torch.softmax(logits.reshape(-1, logits.shape[-1]), -1)
    for chunk in (1, 5, 1000):
        tp = target_draft_probs(d2t=case["d2t"], hidden=hidden, lm_head_weight=lm_w, lm_head_bias=lm_b, chunk_rows=chunk)
        torch.testing.assert_close(tp.probs, p_full[:, case["d2t"]], rtol=1e-6, atol=1e-7)
        outside = torch.tensor([1, 4, 6, 9, 10])  # the target ids the draft vocabulary lacks
        torch.testing.assert_close(tp.outside, p_full[:, outside].sum(-1), rtol=1e-5, atol=1e-6)
    tl = target_draft_probs(d2t=case["d2t"], logits=logits)
    torch.testing.assert_close(tl.probs, tp.probs, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="exactly one of logits and hidden"):
        target_draft_probs(d2t=case["d2t"])


def test_target_probs_from_the_draft_rows_and_a_cached_log_partition_equal_the_full_softmax():
    """training.cached_log_partition: exp(draft-row logit - logsumexp of all logits) is the full softmax
    restricted to the draft vocabulary, whatever the chunking, and the outside mass is what the draft
    vocabulary lacks."""
    case, hidden, lm_w, lm_b, _ = _random_block_case()
    logits = torch.nn.functional.linear(hidden, lm_w, lm_b)
    p_full = torch.softmax(logits.reshape(-1, logits.shape[-1]), -1)
    lse = lm_head_log_partition(hidden=hidden, lm_head_weight=lm_w, lm_head_bias=lm_b, chunk_rows=5)
    assert lse.shape == hidden.shape[:-1]
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-6)
    for chunk in (1, 5, 1000):
        tp = target_draft_probs(d2t=case["d2t"], hidden=hidden, lm_head_weight=lm_w, lm_head_bias=lm_b,
                                chunk_rows=chunk, log_partition=lse)
        torch.testing.assert_close(tp.probs, p_full[:, case["d2t"]], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(tp.outside, p_full[:, [1, 4, 6, 9, 10]].sum(-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="log_partition .* needs hidden"):
        target_draft_probs(d2t=case["d2t"], hidden=hidden, lm_head_weight=lm_w, log_partition=lse[:, :-1])


@pytest.mark.parametrize("compact", [False, True])
def test_per_position_target_probs_give_the_per_slot_reference_loss_and_gradients(compact):
    """The fast path (target softmax once per position, masked slots skipped) against the reference twin
    (softmax of the full logits recomputed for every slot, every slot computed)."""
    case, hidden, lm_w, lm_b, _ = _random_block_case()
    logits = torch.nn.functional.linear(hidden, lm_w, lm_b)
    assert not case["mask"].all() and case["mask"].any()  # some slots are masked: compact has work to skip
    outs = []
    for fast in (False, True):
        c = {**case, "draft_logits": case["draft_logits"].clone().requires_grad_(True)}
        if fast:
            tp = target_draft_probs(d2t=case["d2t"], logits=logits)
            out = block_loss(**c, target_probs=tp, target_vocab_size=11, compact=compact, chunk_rows=4)
        else:
            out = block_loss(**c, target_logits=logits, chunk_rows=4)
        out.loss_sum.backward()
        outs.append((out, c["draft_logits"].grad))
    (ref, ref_grad), (got, got_grad) = outs
    for name in ("loss_sum", "weight_sum", "ce_sum", "tv_sum", "bce_sum", "tau_sum", "num_anchors", "accept_sum",
                 "accept_count"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-6, atol=1e-7)
    assert (got_grad.abs().sum(-1)[~case["mask"]] == 0).all()  # masked slots get no gradient


def test_block_loss_needs_exactly_one_target_side():
    case, *_ = _random_block_case()
    with pytest.raises(ValueError, match="exactly one of target_logits and target_probs"):
        block_loss(**case)
