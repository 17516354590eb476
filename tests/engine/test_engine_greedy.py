import pytest

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.drafters import NGramDrafter, NoDrafter, RandomDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.target.adapter import TargetAdapter

from ._drafters import OracleDrafter, hf_greedy

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_plain_decode_for_any_drafter(arch):
    model = tiny_target(arch, vocab_size=96)
    adapter = TargetAdapter(model)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [3] * 13, [40, 41]]
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(prompts, GREEDY)
    for i, p in enumerate(prompts):
        assert plain[i].output_ids == hf_greedy(model, p, GREEDY.max_new_tokens)
    for drafter in [NGramDrafter(5), RandomDrafter(96, 4), OracleDrafter(model, 4, 2), OracleDrafter(model, 3, 3)]:
        spec = SpeculativeEngine(adapter, drafter).generate(prompts, GREEDY)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain], drafter.name


def test_oracle_drafter_acceptance_is_exact():
    model = tiny_target("llama", vocab_size=96)
    adapter = TargetAdapter(model)
    res = SpeculativeEngine(adapter, OracleDrafter(model, 4, 2)).generate([[1, 2, 3]], GREEDY)[0]
    # 2 good slots then garbage: every full step keeps exactly 2 drafts + the bonus token
    assert set(res.stats.accept_lengths[:-1]) == {3}
    assert res.stats.slot_accepts[2] == 0 and res.stats.slot_attempts[2] > 0
    assert res.stats.conditional_acceptance[:2] == [1.0, 1.0]


def test_batched_requests_match_one_by_one():
    model = tiny_target("qwen3", vocab_size=96, seed=3)
    adapter = TargetAdapter(model)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 12, 13], [50, 51, 52]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    batched = SpeculativeEngine(adapter, NGramDrafter(4)).generate(prompts, params)
    for i, p in enumerate(prompts):
        single = SpeculativeEngine(adapter, NGramDrafter(4)).generate([p], params)[0]
        assert single.output_ids == batched[i].output_ids


def test_eos_and_max_new_tokens_inside_a_block():
    model = tiny_target("llama", vocab_size=96)
    adapter = TargetAdapter(model)
    prompt = [7, 8, 9]
    ref = hf_greedy(model, prompt, 30)
    eos = ref[10]
    first = ref.index(eos)
    eng = SpeculativeEngine(adapter, OracleDrafter(model, 6, 6), eos_token_ids=[eos])
    out = eng.generate([prompt], SamplingParams(max_new_tokens=30))[0]
    assert out.output_ids == ref[:first] and out.finish_reason == "eos"
    out = eng.generate([prompt], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert out.output_ids == ref[:5] and out.finish_reason == "length"


def test_bad_inputs():
    model = tiny_target("llama", vocab_size=96, max_position_embeddings=64)
    eng = SpeculativeEngine(TargetAdapter(model), NoDrafter())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[1], []], GREEDY)
    with pytest.raises(ValueError, match="context"):
        eng.generate([[1] * 80], GREEDY)
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        eng.generate([[1] * 50], SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([[1, 500]], GREEDY)
    out = eng.generate([[1, 2]], SamplingParams(max_new_tokens=0))
    assert out[0].output_ids == [] and out[0].stats.num_steps == 0
    assert eng.generate([], GREEDY) == []
