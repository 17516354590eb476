"""HSPEC registration with SGLang and the spec class the scheduler dispatches on."""

from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

import pytest
import torch

import sglang_hspec.sglang_plugin as plugin


def test_importing_the_plugin_does_not_import_sglang():
    import subprocess
    import sys

    code = "import sys, sglang_hspec.sglang_plugin; print('sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("versions,match", [
    ({"sglang": "0.5.22", "sglang-kernel": "0.4.10"}, r"sglang==0\.5\.23 only .* found sglang 0\.5\.22"),
    ({"sglang": "0.5.23", "sglang-kernel": "0.4.11"}, r"sglang-kernel==0\.4\.10, found 0\.4\.11"),
    ({"sglang-kernel": "0.4.10"}, r"needs SGLang: pip install"),
])
def test_wrong_sglang_version_is_a_clear_error(monkeypatch, versions, match):
    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(plugin.metadata, "version", version)
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(RuntimeError, match=match):
        plugin.register()


# ---- with SGLang ----

@pytest.fixture(scope="module")
def hspec():
    plugin.register()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm.from_string("HSPEC")


@pytest.mark.sglang
def test_register_is_idempotent(hspec, monkeypatch):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_hspec.sglang_plugin.algo import HSpecSpecAlgo

    plugin.register()
    monkeypatch.setattr(plugin, "_registered", False)  # as after a re-import: the registry guards too
    plugin.register()
    assert isinstance(hspec, HSpecSpecAlgo)
    assert SpeculativeAlgorithm.from_string("hspec") is hspec
    assert hspec.supports_overlap is True
    assert hspec.validate_server_args is not None


@pytest.mark.sglang
def test_register_refuses_a_foreign_hspec(monkeypatch):
    from sglang.srt.speculative import spec_registry
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from sglang_hspec.sglang_plugin.algo import register_algorithm

    monkeypatch.setitem(spec_registry._REGISTRY, "HSPEC", CustomSpecAlgo("HSPEC", lambda sa: None))
    with pytest.raises(RuntimeError, match="already registered by another plugin"):
        register_algorithm()


@pytest.mark.sglang
def test_spec_class_passes_sglang_conformance_check():
    from sglang.srt.speculative.spec_registry import _assert_custom_spec_algo_conforms

    from sglang_hspec.sglang_plugin.algo import HSpecSpecAlgo

    _assert_custom_spec_algo_conforms(HSpecSpecAlgo)


@pytest.mark.sglang
@pytest.mark.parametrize("method", ["carries_draft_hidden_states", "create_future_map", "need_topk"])
def test_methods_missing_from_custom_spec_algo_are_added(method):
    # The scheduler calls these for every algorithm; SGLang's conformance check does not see them.
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from sglang_hspec.sglang_plugin.algo import HSpecSpecAlgo

    assert not hasattr(CustomSpecAlgo, method)
    assert callable(getattr(HSpecSpecAlgo, method))


@pytest.mark.sglang
def test_carries_draft_hidden_states_is_false_like_dspark(hspec):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    assert hspec.carries_draft_hidden_states() is False
    assert SpeculativeAlgorithm.DSPARK.carries_draft_hidden_states() is False


@pytest.mark.sglang
def test_need_topk_is_false_like_dspark(hspec):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    assert hspec.need_topk() is False
    assert SpeculativeAlgorithm.DSPARK.need_topk() is False


@pytest.mark.sglang
@pytest.mark.parametrize("relay", [False, True])
def test_create_future_map_builds_a_future_map_for_hspec(hspec, relay):
    from sglang.srt.managers.overlap_utils import FutureMap

    pool = SimpleNamespace(req_to_token=torch.zeros(5, 32, dtype=torch.int32))
    fm = hspec.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False,
                                 needs_confidence_relay=relay)
    assert isinstance(fm, FutureMap)
    assert fm.spec_algo is hspec
    assert fm.req_pool_size == 5
    assert fm.needs_cpu_seq_lens is False
    assert fm.needs_confidence_relay is relay


@pytest.mark.sglang
def test_predicates_match_dspark_except_the_v1_limits(hspec):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    dspark = SpeculativeAlgorithm.DSPARK
    names = sorted(n for n in vars(SpeculativeAlgorithm) if n.startswith(("is_", "supports_")))
    differ = {n for n in names if getattr(hspec, n)() != getattr(dspark, n)()}
    # v1: no mixed chunked prefill and no prefill shared-read-done (docs/architecture.md, "Registration")
    assert differ == {"supports_mixed_chunk", "supports_prefill_shared_read_done"}
    assert hspec.is_dspark() and hspec.is_dflash_family() and not hspec.is_eagle()
    assert hspec.has_draft_kv() is False


@pytest.mark.sglang
def test_tokens_per_request_follow_dspark_rule(hspec):
    # The draft block is the anchor plus gamma - 1 masks: one row fewer than the verify window.
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for is_draft, want in ((True, 7), (False, 8)):
        assert hspec.get_num_tokens_per_req_for_target_verify(8, is_draft_worker=is_draft) == want
        assert SpeculativeAlgorithm.DSPARK.get_num_tokens_per_req_for_target_verify(8, is_draft) == want


@pytest.mark.sglang
def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("hspec") == "sglang_hspec.sglang_plugin:register"
