"""End to end on CPU: SGLang's stock DSPARK on the tiny Qwen3 target through the CPU tier
(tests/sglang_cpu), greedy float32. Speculation must not change a single token."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 32
# SGLang's own spawn start for the HSPEC server (the rest of the tier forks, tests/sglang_cpu/README.md fix 9):
# there the scheduler and detokenizer load both plugins themselves, as they do on GPU
SPAWN = {"SGLANG_CPU_TESTING_FORK": "0"}


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


# The randomly initialised "dspark" draft adds nothing the bigram one does not check (one server less).
@pytest.mark.parametrize("draft,min_mean_accept", [("bigram", 2.0), ("dspark_exported", 1.0)])
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


@pytest.fixture(scope="module")
def hspec_drafts(tiny_checkpoints, tmp_path_factory):
    """H-Spec drafters written by our own save_drafter: random init, and one whose Markov head proposes
    the target's greedy bigrams (real multi-token acceptance through the whole HSPEC path)."""
    from sglang_cpu import builders

    root = tmp_path_factory.mktemp("hspec_drafts")
    target = tiny_checkpoints["target"]
    return {"hspec": builders.build_hspec_draft(root / "hspec", target),
            "hspec_bigram": builders.build_hspec_draft(root / "hspec_bigram", target, bigram=True)}


# Static mode with the bigram drafter is test_sglang_serving.py's server (16 prompts, overlap on and off) and
# compact mode is test_sglang_planner.py's (with SPS and STS files); here the random-weight drafter.
@pytest.mark.parametrize("draft,mode,min_mean_accept", [("hspec", "static", 1.0)])
def test_hspec_greedy_equals_nonspec(tiny_checkpoints, hspec_drafts, sglang_server, baseline_ids, draft, mode,
                                     min_mean_accept):
    """`--speculative-algorithm HSPEC` with an H-Spec checkpoint: the drafter reads the target's KV pool
    and its per-request context state, SGLang's DSpark machinery verifies; greedy output is the target's.
    `compact` also runs the confidence head and the planner's ragged verify widths."""
    from sglang_cpu import builders

    srv = sglang_server(
        tiny_checkpoints["target"], name=f"hspec_{draft}_{mode}", plugins=("sglang_cpu_testing", "hspec"),
        args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(hspec_drafts[draft])],
        env_extra={"SGLANG_RAGGED_VERIFY_MODE": mode, **SPAWN},
    )
    ids, accept = _greedy(srv, builders.PROMPTS)
    assert ids == baseline_ids
    assert "HSpecDraftModel" in srv.log()  # the drafter SGLang loaded is ours
    assert all(a is not None and 1.0 <= a <= 4.0 for a in accept), accept  # block 3: at most 4 per step
    assert sum(accept) / len(accept) >= min_mean_accept, accept
