"""scripts/grow_drafter.py: a grown drafter drafts exactly what it drafted before."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_hspec.model import load_drafter, save_drafter
from sglang_hspec.model.checkpoint import read_checkpoint_weights, write_checkpoint
from sglang_hspec.target.geometry import TargetGeometry
from tests.model._tiny import make_drafter, make_target

OLD_D2T = torch.arange(0, 100)  # target ids 0..99 of the tiny target's 128


@pytest.fixture(scope="module")
def grow(load_script):
    return load_script("grow_drafter")


def test_grown_vocabulary_keeps_old_ids_and_adds_the_most_frequent(grow):
    counts = torch.zeros(128, dtype=torch.float64)
    counts[[120, 110, 105]] = torch.tensor([5.0, 9.0, 5.0], dtype=torch.float64)
    counts[3] = 50.0  # already a draft token: not added twice
    # 110 (9) first, then 105 and 120 tie at 5: the lower id wins the last place; sorted by target id
    assert grow.grown_draft_vocab(OLD_D2T, counts, 102).tolist() == [*range(100), 105, 110]
    with pytest.raises(ValueError, match="growing only adds"):
        grow.grown_draft_vocab(OLD_D2T, counts, 99)


def test_grown_drafter_keeps_every_old_logit_and_confidence(grow, tmp_path):
    target = make_target("qwen3")
    old = make_drafter("hspec", target, draft_vocab_size=90)
    old_d2t = torch.tensor([i for i in range(128) if i % 4 != 1][:90])  # up to id 119, none of 1, 5, 9, ...
    old.set_draft_vocab(old_d2t)
    save_drafter(old, tmp_path / "old")
    # 4 added ids fall between old ones (draft ids shift), rank 16 -> 24
    new_d2t = torch.sort(torch.cat([old_d2t, torch.tensor([1, 5, 9, 13])])).values
    position = torch.searchsorted(new_d2t, old_d2t)
    added = torch.searchsorted(new_d2t, torch.tensor([1, 5, 9, 13]))
    state = grow.grow_state(read_checkpoint_weights(tmp_path / "old"), new_d2t=new_d2t, markov_rank=24,
                            generator=torch.Generator().manual_seed(0))
    config = grow.grow_config(json.loads((tmp_path / "old" / "config.json").read_text()), draft_vocab_size=94,
                              markov_rank=24)
    write_checkpoint(tmp_path / "new", state=state, metadata={"format": "pt"}, config_text=json.dumps(config))
    geom = TargetGeometry.from_hf_config(target.config)
    new = load_drafter(tmp_path / "new", geom, target.model.embed_tokens, target.lm_head, dtype=torch.float64)
    assert new.config.draft_vocab_size == 94 and new.config.markov_rank == 24
    assert new.markov.markov_w1.weight[:, 16:].abs().sum() > 0  # the new rank columns can learn

    h = torch.randn(6, target.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    prev = torch.tensor([4, 119, 5, 13, 125, 2])  # old draft ids, ids added now, ids still outside
    with torch.no_grad():
        a, b = old.head_outputs(h, prev), new.head_outputs(h, prev)
    assert torch.allclose(b.logits[:, position], a.logits, rtol=0, atol=1e-12)
    assert torch.allclose(b.confidence_logits, a.confidence_logits, rtol=0, atol=1e-12)
    # an added token's logit is the backbone's (target LM head row), no Markov bias yet
    assert torch.allclose(b.logits[:, added], new.base_logits(h)[:, added], rtol=0, atol=1e-12)
