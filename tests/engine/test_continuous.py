"""ContinuousDecoder (sglang_hspec/engine/continuous.py): plain decoding with rows refilled as requests end."""

import pytest
import torch

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.continuous import ContinuousDecoder
from sglang_hspec.engine.drafters import NoDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.target.adapter import TargetAdapter

from ._drafters import hf_greedy

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [3] * 13, [40, 41], [60, 61, 62, 63], [70], [20, 21, 22]]


@pytest.mark.parametrize("slots", [1, 2, 3, 16])
def test_greedy_replies_equal_plain_decoding_with_rows_refilled(slots):
    """Seven prompts of mixed lengths, EOS on (ids 2 and 7 end requests at different steps) and a
    max_new_tokens cap: every reply equals Hugging Face greedy decoding of that prompt alone, cut at its
    first EOS, whatever the number of rows shared."""
    model = tiny_target("llama", vocab_size=96, dtype=torch.float64, seed=5)
    adapter = TargetAdapter(model)
    params = SamplingParams(max_new_tokens=18)
    out = ContinuousDecoder(adapter, slots=slots, eos_token_ids=[2, 7]).generate(PROMPTS, params)
    finish = set()
    for prompt, res in zip(PROMPTS, out):
        ref = hf_greedy(model, prompt, params.max_new_tokens)
        cut = next((j for j, t in enumerate(ref) if t in (2, 7)), None)
        assert res.output_ids == (ref if cut is None else ref[:cut])
        assert res.finish_reason == ("length" if cut is None else "eos")
        finish.add(res.finish_reason)
    assert finish == {"length", "eos"}  # both ways of ending a request happen in this batch


def test_same_replies_as_the_engine_and_sampled_draws_reproduce():
    model = tiny_target("qwen3", vocab_size=96, dtype=torch.float64, seed=3)
    adapter = TargetAdapter(model)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = SpeculativeEngine(adapter, NoDrafter()).generate(PROMPTS, greedy)
    cont = ContinuousDecoder(adapter, slots=3).generate(PROMPTS, greedy)
    assert [r.output_ids for r in cont] == [r.output_ids for r in engine]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=11)
    a = ContinuousDecoder(adapter, slots=3).generate(PROMPTS, sampled)
    b = ContinuousDecoder(adapter, slots=3).generate(PROMPTS, sampled)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.output_ids for r in a] != [r.output_ids for r in cont]  # T=1 on a flat tiny target leaves argmax


def test_bad_requests_are_refused_with_the_reason():
    adapter = TargetAdapter(tiny_target("llama", vocab_size=96))
    with pytest.raises(ValueError, match="slots must be >= 1"):
        ContinuousDecoder(adapter, slots=0)
    with pytest.raises(ValueError, match="stop strings"):
        ContinuousDecoder(adapter).generate([[1, 2]], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match=r"prompt 1: .*\[0, 96\)"):
        ContinuousDecoder(adapter).generate([[1, 2], [1, 500]], SamplingParams())
