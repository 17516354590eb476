"""What the HookRegistry hooks change in SGLang's SPS profiler, as pure functions (no SGLang needed);
test_sglang_sps_profile.py runs them inside the real profiler."""

from __future__ import annotations

import sys

import pytest

from sglang_hspec.sglang_plugin import sps_hooks


def test_hspec_reads_as_dspark_and_nothing_else_changes():
    info = {"speculative_algorithm": "HSPEC", "device": "cuda", "disable_cuda_graph": True, "tp_size": 2}
    seen = sps_hooks.server_info_for_profiler(info)
    assert seen == {**info, "speculative_algorithm": "DSPARK"}  # a GPU server without graphs is still refused
    assert info["speculative_algorithm"] == "HSPEC"  # the caller's dict is not modified
    for algorithm in ("DSPARK", "EAGLE", None):  # other algorithms are judged by SGLang as before
        assert sps_hooks.server_info_for_profiler({"speculative_algorithm": algorithm}) == {
            "speculative_algorithm": algorithm}


def test_a_cpu_server_needs_no_cuda_graphs():
    seen = sps_hooks.server_info_for_profiler({"speculative_algorithm": "HSPEC", "device": "cpu",
                                               "disable_cuda_graph": True})
    assert seen["disable_cuda_graph"] is False and seen["speculative_algorithm"] == "DSPARK"


def test_on_cpu_the_sweep_is_bounded_by_the_running_cap_not_a_graph_capture_list():
    state = {"effective_max_running_requests_per_dp": 48, "cuda_graph_config": {"decode": {"bs": [1, 2, 4, 8, 16, 32]}}}
    cpu = sps_hooks.server_info_for_profiler({"speculative_algorithm": "HSPEC", "device": "cpu",
                                              "internal_states": [state]})
    assert cpu["internal_states"] == [{**state, "cuda_graph_config": {"decode": {"max_bs": 48}}}]
    assert state["cuda_graph_config"]["decode"]["bs"][-1] == 32  # the caller's state is not modified
    gpu = sps_hooks.server_info_for_profiler({"speculative_algorithm": "HSPEC", "device": "cuda",
                                              "internal_states": [state]})
    assert gpu["internal_states"] == [state]  # on GPU the captured graphs bound the sweep, as in SGLang


def test_a_never_drafting_server_reads_as_verifying_one_token_per_request():
    # SGLang's profiler expects requests x speculative_num_draft_tokens verify tokens per step; a server
    # with HSPEC_SPECULATION=never verifies the anchor only (the launcher's plain-probe profile failed on it)
    payload = {"mode": "static", "verify_num_draft_tokens": 8}
    info = {"speculative_algorithm": "HSPEC", "device": "cpu", "speculative_num_draft_tokens": 8,
            "internal_states": [{"dspark_info_record": payload}]}

    def widths(seen):  # the server's and each rank's step-record payload (what the profiler reads)
        return seen["speculative_num_draft_tokens"], seen["internal_states"][0]["dspark_info_record"][
            "verify_num_draft_tokens"]

    assert widths(sps_hooks.server_info_for_profiler(info)) == (8, 8)
    with sps_hooks.anchor_only_profile():
        assert widths(sps_hooks.server_info_for_profiler(info)) == (1, 1)
    assert widths(sps_hooks.server_info_for_profiler(info)) == (8, 8)  # restored on exit
    assert widths(sps_hooks.server_info_for_profiler(info, anchor_only=True)) == (1, 1)
    assert widths(info) == (8, 8) and payload["mode"] == "static"  # the caller's dicts are not modified


def test_prompt_ids_fit_small_vocabularies():
    assert sps_hooks.prompt_id_range(151936, 1000, 1000) == (1000, 1000)  # SGLang's own range
    assert sps_hooks.prompt_id_range(2001, 1000, 1000) == (1000, 1000)  # ids [1000, 1001): still one id
    assert sps_hooks.prompt_id_range(2000, 1000, 1000) == (250, 250)  # SGLang's range would be empty
    assert sps_hooks.prompt_id_range(1024, 1000, 1000) == (128, 128)  # the tiny test target
    with pytest.raises(ValueError, match="vocab_size=4"):
        sps_hooks.prompt_id_range(4, 1000, 1000)


def test_install_registers_nothing_where_the_profiler_is_not_imported(monkeypatch):
    # server processes call register() -> install(): they must not import the ~10 s profiler module.
    # Other tests of the session may have imported and installed it: look like a fresh process.
    monkeypatch.setattr(sps_hooks, "_installed", False)
    monkeypatch.delitem(sys.modules, sps_hooks.PROFILER_MODULE, raising=False)
    assert sps_hooks.install() is False
    assert sps_hooks.PROFILER_MODULE not in sys.modules
