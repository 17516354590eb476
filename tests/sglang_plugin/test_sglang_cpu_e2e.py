"""End to end on CPU: SGLang's stock DSPARK on the tiny Qwen3 target through the CPU tier
(tests/sglang_cpu), greedy float32. Speculation must not change a single token."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 32


def _greedy(srv, prompts):
    outs = srv.generate(prompts, MAX_NEW)
    return [o["output_ids"] for o in outs], [o["meta_info"].get("spec_accept_length") for o in outs]


@pytest.fixture(scope="module")
def baseline_ids(tiny_checkpoints):
    """Golden greedy ids from HF transformers (float32); the non-speculative server is checked against
    these in test_nonspec_server_matches_hf."""
    from sglang_cpu import builders

    return builders.hf_greedy(tiny_checkpoints["target"], builders.PROMPTS, MAX_NEW)


def test_nonspec_server_matches_hf(tiny_checkpoints, sglang_server, baseline_ids):
    from sglang_cpu import builders

    srv = sglang_server(tiny_checkpoints["target"], name="nonspec")
    ids, accept = _greedy(srv, builders.PROMPTS)
    assert ids == baseline_ids
    assert accept == [None] * len(ids)  # no speculation reported


@pytest.mark.parametrize("draft,min_mean_accept", [("dspark", 1.0), ("bigram", 2.0)])
def test_dspark_greedy_equals_nonspec(tiny_checkpoints, sglang_server, baseline_ids, draft, min_mean_accept):
    from sglang_cpu import builders

    srv = sglang_server(
        tiny_checkpoints["target"], name=f"dspark_{draft}",
        args=["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(tiny_checkpoints[draft])],
    )
    ids, accept = _greedy(srv, builders.PROMPTS)
    assert ids == baseline_ids
    assert all(a is not None and 1.0 <= a <= 4.0 for a in accept), accept  # gamma 3: at most 4 per step
    # The bigram draft proposes the target's own continuation: real multi-token acceptance.
    assert sum(accept) / len(accept) >= min_mean_accept, accept
