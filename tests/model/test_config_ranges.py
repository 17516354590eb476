"""Every drafter config field is range-checked when the config is read: the message names the field,
the allowed range and the fix, before a single tensor is allocated (a mistyped width would ask torch for
terabytes). The cases start from the shipped SmolLM2 drafter's config (hidden size 576, draft vocab 8192)."""

import json
from pathlib import Path

import pytest

from sglang_hspec.model.config import HSpecConfig, check_field_values

SHIPPED = json.loads((Path(__file__).resolve().parents[2] / "sglang_hspec/checkpoints/hspec-smollm2/config.json")
                     .read_text())["hspec"]

CASES = {  # field -> (bad value, the whole message)
    "block_size": (100000, "block_size must be an integer in 1..64 (draft tokens per block), got 100000; set it in "
                           "1..64 (H-Spec uses 7)"),
    "block_size_str": ("7", "block_size must be an integer (draft tokens per block), got '7'; H-Spec uses 7"),
    "mamba_state_dim": (10**6, "mamba_state_dim must be an integer in 1..256 (the Mamba state per head channel), got "
                               "1000000; set it in 1..256 (H-Spec uses 4)"),
    "mamba_conv_kernel": (0, "mamba_conv_kernel must be an integer in 1..16 (the Mamba causal-conv width), got 0; set "
                             "it in 1..16 (H-Spec uses 4)"),
    "mamba_groups": (0, "mamba_groups must be an integer in 1..4096 (Mamba B/C groups), got 0; set it in 1..4096 "
                        "(H-Spec uses 4)"),
    "sliding_window": (0, "sliding_window must be an integer in 1..1048576 (target tokens the drafter's attention "
                          "reads), got 0; set it in 1..1048576 (H-Spec uses 2048)"),
    "mask_token_id": (-1, "mask_token_id must be an integer >= 0 (the token id of a block's mask slots), got -1; set "
                          "it >= 0 (H-Spec uses an unused id, e.g. 16 on SmolLM2)"),
    "mamba_dt_max": (float("nan"), "mamba_dt_max must be a finite number in (0, 1] (the largest initial Mamba step "
                                   "size), got nan; H-Spec uses 0.1"),
    "rms_norm_eps": (0, "rms_norm_eps must be a finite number in (0, 0.1] (the RMSNorm epsilon), got 0; H-Spec uses "
                        "the target's, 1e-5 or 1e-6"),
    "confidence_head": ("yes", "confidence_head must be true or false (whether the drafter has a confidence head), got "
                               "'yes'"),
    # bounded against the target (hidden size 576) and the draft vocabulary
    "intermediate_size": (10**9, "intermediate_size is 1000000000, above 9216 (16 x the target's hidden size 576); "
                                 "set intermediate_size to at most that (3-4 x the hidden size is usual)"),
    "mamba_head_dim": (512 * 2, "mamba_head_dim must be an integer in 1..512 (the width of one Mamba head), got 1024; "
                                "set it in 1..512 (H-Spec uses 64)"),
    "mamba_num_heads": (512, "mamba_num_heads x mamba_head_dim is 32768, above 4608 (8 x the target's hidden size "
                             "576); lower mamba_num_heads or mamba_head_dim (H-Spec's inner width is 0.5-1.1 x the "
                             "hidden size)"),
    "fusion_rank": (2881, "fusion_rank is 2881, above 2880 (the 5 fused target hidden states, 5 x 576); set "
                          "fusion_rank to at most that (H-Spec uses the hidden size)"),
    "markov_rank": (8194, "markov_rank 8194 exceeds draft_vocab_size + 1 = 8193 (the rank of a full bigram table over "
                          "the draft vocabulary); set markov_rank in 0..8193"),
    "mamba_dt_min": (0.5, "mamba_dt_min (0.5) must be <= mamba_dt_max (0.1): they bound the initial Mamba step sizes "
                          "(H-Spec uses 0.001 and 0.1)"),
    "target_layer_ids": (5, "target_layer_ids must be a list of target layer ids (integers), got 5"),
    "layer_pattern": ("MAF", "layer_pattern must be a list of layer strings such as ['MAF', 'MAF', 'MAF', 'MF'], got "
                             "'MAF'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_field_names_field_range_and_fix(case):
    value, message = CASES[case]
    field = case.removesuffix("_str")
    with pytest.raises(ValueError) as err:
        HSpecConfig.from_dict({**SHIPPED, field: value})
    assert str(err.value) == message


def test_edges_of_each_range_are_accepted():
    """The bounds themselves are valid (a range off by one would refuse a real config)."""
    for change in ({"block_size": 1}, {"block_size": 64}, {"markov_rank": 8193}, {"markov_rank": 0},
                   {"fusion_rank": 2880}, {"intermediate_size": 16 * 576}, {"mamba_num_heads": 72},
                   {"sliding_window": 1}, {"mamba_dt_min": 0.1}, {"rms_norm_eps": 0.1}):
        cfg = HSpecConfig.from_dict({**SHIPPED, **change})
        assert all(getattr(cfg, k) == v for k, v in change.items())


def test_missing_fields_and_a_config_that_is_not_an_object():
    section = {k: v for k, v in SHIPPED.items() if k != "mask_token_id"}
    with pytest.raises(ValueError) as err:
        HSpecConfig.from_dict(section)
    assert str(err.value) == ("drafter config lacks the required fields ['mask_token_id']; required: ['target', "
                              "'target_layer_ids', 'mask_token_id', 'intermediate_size']")
    with pytest.raises(ValueError, match="^a drafter config is a JSON object of HSpecConfig fields, got int$"):
        HSpecConfig.from_dict(5)
    with pytest.raises(ValueError, match="^target must be a mapping of TargetGeometry fields, got NoneType$"):
        HSpecConfig.from_dict({**SHIPPED, "target": None})


def test_check_field_values_prefixes_the_key_and_skips_absent_fields():
    check_field_values({"markov_rank": 0})  # a partial section: only what is there is checked
    with pytest.raises(ValueError) as err:
        check_field_values({"markov_rank": -1}, prefix="model.drafter.")
    assert str(err.value).startswith("model.drafter.markov_rank must be an integer >= 0 (the Markov head's rank")
    with pytest.raises(ValueError, match="^model.drafter.mamba_expand must be an integer"):
        check_field_values({"mamba_expand": True}, prefix="model.drafter.")  # a bool is not a count
