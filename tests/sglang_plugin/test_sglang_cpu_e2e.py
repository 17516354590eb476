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


def test_hspec_launch_reaches_the_worker_in_the_scheduler(tiny_checkpoints, tmp_path, sglang_server):
    """`--speculative-algorithm HSPEC` parses in the launcher (plugin loaded before argument parsing),
    passes our argument handling, and the scheduler process builds HSpecWorkerV2, which stops at the
    missing draft-model adapter with its clear error. When the adapter lands, this becomes the HSPEC
    greedy-parity case."""
    from sglang_cpu import builders

    draft = builders.build_hspec_draft_config(tmp_path / "hspec", tiny_checkpoints["target"])
    with pytest.raises(RuntimeError, match="exited") as err:
        sglang_server(tiny_checkpoints["target"], name="hspec", plugins=("sglang_cpu_testing", "hspec"),
                      args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(draft)])
    log = str(err.value)
    assert "sglang_hspec/sglang_plugin/worker.py" in log and "in __init__" in log
    assert "NotImplementedError: HSPEC serving needs the SGLang adapter for the H-Spec drafter" in log
