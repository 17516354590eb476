"""Tree verification on the embedded SmolLM2 target with the shipped H-Spec drafter + prompt lookup, fp32:
greedy outputs token-identical to plain decoding at batch 1 and batch 2 (two MT-Bench prompts, 48 tokens),
and the tree keeps more tokens per step than the drafter's chain on the same prompts."""

import pytest

from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.drafters import NoDrafter
from sglang_hspec.engine.engine import SpeculativeEngine, generate_tree
from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR, load_drafter_spec
from sglang_hspec.engine.tree import TreeSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.skipif(not (SHIPPED_DRAFTER_DIR / "config.json").is_file(), reason="no shipped drafter")
def test_tree_with_shipped_drafter_is_greedy_identical(embedded_adapter_fp32):
    adapter = embedded_adapter_fp32
    prompts = [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in load_prompts("mtbench", limit=2)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    drafter = load_drafter_spec("shipped+lookup", adapter)
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(prompts, params)
    chain = SpeculativeEngine(adapter, drafter).generate(prompts, params)
    tree = generate_tree(adapter, drafter, prompts, params, spec=TreeSpec(max_rows=16))
    assert [r.output_ids for r in tree] == [r.output_ids for r in plain]
    single = generate_tree(adapter, drafter, prompts[1:], params, spec=TreeSpec(max_rows=16))
    assert single[0].output_ids == plain[1].output_ids
    tokens = sum(len(r.output_ids) for r in tree)
    assert sum(r.stats.num_steps for r in tree) < sum(r.stats.num_steps for r in chain), (
        [r.stats.tau for r in tree], [r.stats.tau for r in chain], tokens)
