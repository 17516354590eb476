"""Which SPS table an HSPEC server uses: the auto-profile cache key and path, the settings from the
environment, and the decision (given table / cached / profile once / WARNING). Pure: runs without SGLang
(the profiling itself is replaced by a fake that writes a table; the real one is tested in
test_sglang_sps_profile.py)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_hspec.scheduler import SpsCostTable, load_sps_table, save_sps_table

from sglang_hspec.sglang_plugin import sps_cache, sps_profile
from sglang_hspec.sglang_plugin.sps_cache import SpsCacheKey

KEY = SpsCacheKey(device_name="NVIDIA H200", model="/models/Qwen3-8B", draft_model="/drafters/hspec-qwen3-8b",
                  tp_size=2, dtype="bfloat16")
TABLE = SpsCostTable(sample_batch_tokens=[4, 8], sample_steps_per_sec=[40.0, 30.0], max_batch_tokens=192)
COMPACT = {"SGLANG_RAGGED_VERIFY_MODE": "compact", "HSPEC_AUTO_PROFILE_SPS": "1"}


def test_file_name_is_readable_and_unique_by_the_full_key():
    digest = hashlib.sha256(json.dumps(asdict(KEY), sort_keys=True).encode()).hexdigest()
    assert KEY.digest() == digest
    assert KEY.file_name() == f"NVIDIA-H200__Qwen3-8B__tp2__bfloat16-{digest[:12]}.json"
    changed = [SpsCacheKey(**{**asdict(KEY), field: value}) for field, value in (
        ("device_name", "NVIDIA H100 80GB HBM3"), ("model", "/other/Qwen3-8B"), ("draft_model", "/d2"),
        ("tp_size", 4), ("dtype", "float16"))]
    names = {KEY.file_name(), *(k.file_name() for k in changed)}
    assert len(names) == 6  # same basename in another folder still differs: the hash covers full paths


def test_cache_dir_honours_hspec_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path / "c"))
    assert sps_cache.table_path_for(KEY) == tmp_path / "c" / "sps" / KEY.file_name()
    monkeypatch.delenv("HSPEC_CACHE_DIR")
    assert sps_cache.table_path_for(KEY) == Path.home() / ".cache" / "sglang-hspec" / "sps" / KEY.file_name()
    assert sps_cache.table_path_for(KEY, tmp_path) == tmp_path / KEY.file_name()


def test_key_from_server_args_resolves_local_paths_and_keeps_hub_ids(tmp_path, monkeypatch):
    (tmp_path / "target").mkdir()
    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(model_path="./target", speculative_draft_model_path="org/hspec-drafter", tp_size=2,
                           dtype="float32", device="cpu", base_gpu_id=0)
    key = SpsCacheKey.from_server_args(args)
    assert key.model == str((tmp_path / "target").resolve())
    assert key.draft_model == "org/hspec-drafter"
    assert (key.tp_size, key.dtype) == (2, "float32")
    assert key.device_name.startswith("cpu ")
    same = SpsCacheKey.from_server_args(SimpleNamespace(**{**vars(args), "model_path": str(tmp_path / "target")}))
    assert same == key
    # a local drafter by its config.json: copies share the key, another architecture at the same path does not
    for name in ("d1", "d2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"block_size": 7}')
    one, two = (SpsCacheKey.from_server_args(SimpleNamespace(**{**vars(args), "speculative_draft_model_path":
                                                                str(tmp_path / n)})) for n in ("d1", "d2"))
    assert one == two and one.draft_model.startswith("config sha256 ") and len(one.draft_model) == 14 + 16
    (tmp_path / "d2" / "config.json").write_text('{"block_size": 5}')
    assert SpsCacheKey.from_server_args(SimpleNamespace(**{**vars(args), "speculative_draft_model_path":
                                                           str(tmp_path / "d2")})) != one
    # fields SGLang leaves unset fall back to its defaults
    bare = SpsCacheKey.from_server_args(SimpleNamespace(model_path="m", device="cpu"))
    assert (bare.tp_size, bare.dtype, bare.draft_model) == (1, "auto", "")


def test_device_name():
    assert sps_cache.device_name("cpu").startswith("cpu ")
    import torch

    if not torch.cuda.is_available():
        assert sps_cache.device_name("cuda:0") == "cuda unknown"
        assert sps_cache.device_name(None).startswith("cpu ")


def test_auto_profile_settings_from_the_environment():
    assert sps_cache.auto_profile_settings({}) == {"min_steady_steps": 16, "min_steady_seconds": 2.0}
    env = {"HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES": "1, 2,4", "HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS": "4",
           "HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "0"}
    assert sps_cache.auto_profile_settings(env) == {"batch_sizes": [1, 2, 4], "min_steady_steps": 4,
                                                    "min_steady_seconds": 0.0}
    with pytest.raises(ValueError, match="HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES"):
        sps_cache.auto_profile_settings({"HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES": "1,0"})
    with pytest.raises(ValueError, match="HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS"):
        sps_cache.auto_profile_settings({"HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "soon"})


# ------------------------------------------------------------------ resolve_sps_table

def _server_args(tmp_path, **kw):
    base = dict(model_path=str(tmp_path), speculative_draft_model_path=str(tmp_path), tp_size=1,
                dtype="float32", device="cpu", base_gpu_id=0, speculative_dspark_sps_table_path=None)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture
def fake_profile(monkeypatch, tmp_path):
    """Replace the profiling server by a fake that records its settings and writes TABLE."""
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def profile_with_server(*, out, settings, plain_probes=False, greedy_probes=False):
        calls.append(settings)
        save_sps_table(TABLE, out)

    monkeypatch.setattr(sps_profile, "profile_with_server", profile_with_server)
    return calls


def test_auto_profile_profiles_once_then_reuses_the_cache(tmp_path, fake_profile, caplog):
    caplog.set_level(logging.INFO)
    args = _server_args(tmp_path)
    path = sps_cache.resolve_sps_table(args, block_size=7, environ=COMPACT)
    key = SpsCacheKey.from_server_args(args)
    assert path == tmp_path / "cache" / "sps" / key.file_name()
    assert args.speculative_dspark_sps_table_path == str(path)  # what SGLang's planner loads
    assert load_sps_table(path) == TABLE
    assert json.loads(sps_cache.key_sidecar(path).read_text()) == asdict(key)
    assert fake_profile == [{"min_steady_steps": 16, "min_steady_seconds": 2.0}]
    assert "profiling once" in caplog.text

    caplog.clear()
    again = _server_args(tmp_path)
    assert sps_cache.resolve_sps_table(again, block_size=7, environ=COMPACT) == path
    assert again.speculative_dspark_sps_table_path == str(path)
    assert len(fake_profile) == 1  # not profiled again
    assert f"reusing cached SPS table {path}" in caplog.text

    other = _server_args(tmp_path, tp_size=2)  # another key: profiled separately
    assert sps_cache.resolve_sps_table(other, block_size=7, environ=COMPACT) != path
    assert len(fake_profile) == 2


def test_unusable_cached_table_is_profiled_again(tmp_path, fake_profile, caplog):
    args = _server_args(tmp_path)
    path = sps_cache.table_path_for(SpsCacheKey.from_server_args(args))
    path.parent.mkdir(parents=True)
    path.write_text('{"sample_batch_tokens":[1],"sample_steps_per_sec":[1.0],"max_batch_tokens":8}')
    assert sps_cache.resolve_sps_table(args, block_size=7, environ=COMPACT) == path
    assert len(fake_profile) == 1 and load_sps_table(path) == TABLE
    assert "is unusable" in caplog.text and "placeholder" in caplog.text


def test_without_table_and_auto_profile_a_warning_says_full_block_and_how(tmp_path, fake_profile, caplog):
    args = _server_args(tmp_path)
    assert sps_cache.resolve_sps_table(args, block_size=7, environ={"SGLANG_RAGGED_VERIFY_MODE": "compact"}) is None
    assert args.speculative_dspark_sps_table_path is None and fake_profile == []
    [record] = [r for r in caplog.records if r.name == sps_cache.__name__]
    assert record.levelno == logging.WARNING
    msg = record.getMessage()
    assert "every request verifies its full block of 7 draft tokens (fixed k)" in msg
    assert "HSPEC_AUTO_PROFILE_SPS=1" in msg and "hspec profile-sps --url" in msg


@pytest.mark.parametrize("auto", [False, True])
def test_static_mode_warns_and_never_profiles(tmp_path, fake_profile, caplog, auto):
    env = {"HSPEC_AUTO_PROFILE_SPS": "1"} if auto else {}  # static is SGLang's default mode
    assert sps_cache.resolve_sps_table(_server_args(tmp_path), block_size=3, environ=env) is None
    assert fake_profile == []
    msg = caplog.records[-1].getMessage()
    assert caplog.records[-1].levelno == logging.WARNING
    assert "SGLANG_RAGGED_VERIFY_MODE=static: every request verifies its full block of 3 draft tokens" in msg
    assert ("is ignored in static mode" in msg) == auto


def test_given_table_is_checked_and_used(tmp_path, fake_profile, caplog):
    good = tmp_path / "sps.json"
    save_sps_table(TABLE, good)
    args = _server_args(tmp_path, speculative_dspark_sps_table_path=str(good))
    assert sps_cache.resolve_sps_table(args, environ=COMPACT) == good
    assert fake_profile == [] and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    bad = tmp_path / "bad.json"
    bad.write_text('{"sample_batch_tokens":[8,4],"sample_steps_per_sec":[1.0,2.0],"max_batch_tokens":8}')
    with pytest.raises(ValueError, match="sample_batch_tokens"):
        sps_cache.resolve_sps_table(_server_args(tmp_path, speculative_dspark_sps_table_path=str(bad)),
                                    environ=COMPACT)


def test_the_profiling_server_neither_profiles_nor_warns(tmp_path, fake_profile, caplog):
    env = {**COMPACT, "HSPEC_SPS_PROFILING_SERVER": "1"}
    assert sps_cache.resolve_sps_table(_server_args(tmp_path), block_size=7, environ=env) is None
    assert fake_profile == [] and caplog.records == []


def test_failed_auto_profile_logs_an_error_and_serves_without_table(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path / "cache"))

    def broken(**_):
        raise RuntimeError("the profiling server exited with 1")

    monkeypatch.setattr(sps_profile, "profile_with_server", broken)
    args = _server_args(tmp_path)
    assert sps_cache.resolve_sps_table(args, block_size=7, environ=COMPACT) is None
    assert args.speculative_dspark_sps_table_path is None
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "exited with 1" in error.getMessage() and "verifies its full block" in error.getMessage()
    assert not list((tmp_path / "cache" / "sps").glob("*.json"))
