"""The stride-1 pieces of a decode step without drafting (sglang_plugin/plain_step.py): the forward setting,
the packed anchor rows of a width-1 window, and the bonus draw from the anchor row (greedy: argmax; sampled:
the verify distribution, checked by chi-square tests with a fixed seed and a stated power). Needs SGLang
(imported by the module); the served path: test_sglang_plain_step.py, test_sglang_speculation_switch.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.sglang]

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])  # argmax 5; second 0
DRAWS = 6000
ALPHA = 1e-3


def _sampling(bs, *, temperature=1.0, top_k=-1, top_p=1.0, greedy_rows=()):
    top_ks = torch.full((bs,), top_k if top_k > 0 else 1 << 30, dtype=torch.int32)
    top_ks[list(greedy_rows)] = 1
    return SimpleNamespace(
        is_all_greedy=len(greedy_rows) == bs, is_any_greedy=len(greedy_rows) > 0,
        need_top_k_sampling=top_k > 0, need_top_p_sampling=top_p < 1.0,
        temperatures=torch.full((bs, 1), temperature), top_ks=top_ks, top_ps=torch.full((bs,), top_p),
    )


def _chi2_p_and_power(counts, expected_p, wrong_p):
    from scipy import stats

    n = counts.sum()
    exp, wrong = n * expected_p, n * wrong_p
    keep = exp > 0
    chi2 = float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert counts[~keep].sum() == 0, "a token outside the distribution's support was drawn"
    noncentrality = float(((wrong[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    power = float(stats.ncx2.sf(stats.chi2.isf(ALPHA, dof), dof, noncentrality))
    return float(stats.chi2.sf(chi2, dof)), power


def test_plain_step_forward_is_auto_unless_verify_is_asked(monkeypatch):
    from sglang_hspec.sglang_plugin.plain_step import FORWARD_ENV, plain_step_forward

    monkeypatch.delenv(FORWARD_ENV, raising=False)
    assert plain_step_forward() == "auto"
    monkeypatch.setenv(FORWARD_ENV, " Verify ")
    assert plain_step_forward() == "verify"
    monkeypatch.setenv(FORWARD_ENV, "decode")
    with pytest.raises(ValueError, match="HSPEC_PLAIN_STEP_FORWARD='decode'.*auto, verify"):
        plain_step_forward()


def test_anchor_window_packs_one_row_per_request():
    from sglang_hspec.sglang_plugin.plain_step import anchor_window

    window = anchor_window(anchor=torch.tensor([7, 8, 9]), prefix_lens=torch.tensor([4, 10, 2]),
                           write_loc=torch.tensor([104, 210, 302]), num_tokens=3)
    assert window.verify_ids.tolist() == [7, 8, 9]
    assert window.positions.tolist() == [4, 10, 2]
    assert window.verify_cache_loc.tolist() == [104, 210, 302]
    assert window.window_index.tolist() == [0, 1, 2]


def test_anchor_window_pads_graph_lanes_with_the_sink():
    from sglang_hspec.sglang_plugin.plain_step import anchor_window

    window = anchor_window(anchor=torch.tensor([7, 8]), prefix_lens=torch.tensor([4, 10], dtype=torch.int32),
                           write_loc=torch.tensor([104, 210]), num_tokens=4)
    assert window.verify_ids.tolist() == [7, 8, 0, 0]
    assert window.positions.tolist() == [4, 10, 0, 0] and window.positions.dtype == torch.int64
    assert window.verify_cache_loc.tolist() == [104, 210, 0, 0]
    assert window.window_index.tolist() == [0, 1, -1, -1]


def test_greedy_bonus_is_the_argmax_of_each_anchor_row():
    from sglang_hspec.sglang_plugin.plain_step import draw_anchor_bonus

    logits = torch.stack([LOGITS, LOGITS.flip(0), torch.tensor([0.0, 0.0, 9.0, 0.0, 0.0, 0.0])])
    for info in (None, _sampling(3, greedy_rows=(0, 1, 2))):
        bonus = draw_anchor_bonus(logits=logits, sampling_info=info, draft_input=None, fused_argmax=False)
        assert bonus.tolist() == [5, 0, 2]
        assert bonus.dtype == torch.int64


def test_mixed_batch_keeps_greedy_rows_at_the_argmax():
    from sglang_hspec.sglang_plugin.plain_step import draw_anchor_bonus

    torch.manual_seed(0)
    logits = LOGITS.repeat(400, 1)
    info = _sampling(400, temperature=1.0, greedy_rows=range(0, 400, 2))
    bonus = draw_anchor_bonus(logits=logits, sampling_info=info, draft_input=None, fused_argmax=False)
    assert bonus[0::2].tolist() == [5] * 200
    assert len(set(bonus[1::2].tolist())) > 1  # the sampled rows are not the argmax every time


def test_sampled_bonus_follows_the_tempered_target_distribution():
    from sglang_hspec.sglang_plugin.plain_step import draw_anchor_bonus

    torch.manual_seed(1234)
    temperature = 0.7
    info = _sampling(DRAWS, temperature=temperature)
    bonus = draw_anchor_bonus(logits=LOGITS.repeat(DRAWS, 1), sampling_info=info, draft_input=None,
                              fused_argmax=False)
    counts = torch.bincount(bonus, minlength=6).double()
    p = torch.softmax(LOGITS.double() / temperature, -1)
    wrong = torch.softmax(LOGITS.double() / 0.8, -1)  # power stated against one wrong rule: temperature 0.8
    p_value, power = _chi2_p_and_power(counts, p, wrong)
    assert power > 0.99, "the test would not catch a wrong temperature: raise DRAWS"
    assert p_value > ALPHA, (counts.tolist(), p.tolist())


def _on(tokens, logits):
    """The softmax of `logits` over `tokens`, zero elsewhere (vocabulary 6)."""
    p = torch.zeros(6, dtype=torch.float64)
    p[tokens] = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1)
    return p


def test_sampled_bonus_applies_top_k_as_the_verify_does():
    from sglang_hspec.sglang_plugin.plain_step import draw_anchor_bonus

    torch.manual_seed(99)
    # top-k 3 keeps tokens 5, 0, 1 (logits 3, 2, 1), renormalised
    bonus = draw_anchor_bonus(logits=LOGITS.repeat(DRAWS, 1), sampling_info=_sampling(DRAWS, top_k=3),
                              draft_input=SimpleNamespace(max_top_k=3, uniform_top_k_value=3), fused_argmax=False)
    counts = torch.bincount(bonus, minlength=6).double()
    # a wrong top-k draws outside the support (the support check); power stated for temperature 0.8 instead of 1
    wrong = _on([5, 0, 1], [3.0 / 0.8, 2.0 / 0.8, 1.0 / 0.8])
    p_value, power = _chi2_p_and_power(counts, _on([5, 0, 1], [3.0, 2.0, 1.0]), wrong)
    assert power > 0.99, "the test would not catch temperature 0.8 instead of 1: raise DRAWS"
    assert p_value > ALPHA, counts.tolist()


def test_sampled_bonus_applies_top_p_after_top_k_as_the_verify_does():
    from sglang_hspec.sglang_plugin.plain_step import draw_anchor_bonus

    torch.manual_seed(7)
    # top-k 3 leaves probabilities [0.665, 0.245, 0.090] on tokens 5, 0, 1; top-p 0.85 keeps the smallest prefix
    # reaching 0.85: tokens 5 and 0, renormalised. Drawing token 1 (a wrong rule) fails the support check.
    info = _sampling(DRAWS, top_k=3, top_p=0.85)
    bonus = draw_anchor_bonus(logits=LOGITS.repeat(DRAWS, 1), sampling_info=info,
                              draft_input=SimpleNamespace(max_top_k=3, uniform_top_k_value=3), fused_argmax=False)
    counts = torch.bincount(bonus, minlength=6).double()
    p_value, power = _chi2_p_and_power(counts, _on([5, 0], [3.0, 2.0]), _on([5, 0], [3.0 / 0.8, 2.0 / 0.8]))
    assert power > 0.99, "the test would not catch temperature 0.8 instead of 1: raise DRAWS"
    assert p_value > ALPHA, counts.tolist()
