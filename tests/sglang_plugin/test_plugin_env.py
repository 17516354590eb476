"""The plugin's environment variables: the on/off switches share one parser (sglang_plugin/env.py) that refuses a
typo instead of reading it as off, the auto-profile's steady-state settings refuse 0 steps and nan/inf seconds at
launch (not inside the profile's try, which would swallow them), and HSPEC_STEP_PROFILE is checked writable at
startup. Pure: runs without SGLang."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_hspec.sglang_plugin import sps_cache, sps_profile, step_timer
from sglang_hspec.sglang_plugin.env import env_switch
from sglang_hspec.sglang_plugin.lookup_splice import lookup_enabled
from sglang_hspec.sglang_plugin.speculation_policy import speculation_guard

SWITCHES = {  # variable -> (its reader, the message for a typo)
    "HSPEC_LOOKUP": (lookup_enabled, "HSPEC_LOOKUP='yes1': use 1 (splice prompt lookup into the drafts) or 0 "
                                     "(do not); unset, it is 0"),
    "HSPEC_AUTO_PROFILE_SPS": (sps_cache.auto_profile_enabled,
                               "HSPEC_AUTO_PROFILE_SPS='yes1': use 1 (profile an SPS table once at startup and cache "
                               "it) or 0 (do not profile; serve with the given table, or none); unset, it is 0"),
    "HSPEC_SPS_PROFILING_SERVER": (sps_cache.is_profiling_server,
                                   "HSPEC_SPS_PROFILING_SERVER='yes1': use 1 (this is the auto-profile's measuring "
                                   "server: no table of its own) or 0 (a serving server; leave it unset); unset, it "
                                   "is 0"),
    "HSPEC_SPECULATION_GUARD": (speculation_guard,
                                "HSPEC_SPECULATION_GUARD='yes1': use 1 (correct the auto switch by the rates this "
                                "server realizes) or 0 (trust the SPS table and the stale estimates alone); unset, it "
                                "is 1"),
}


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_on_off_variables_share_one_parser_and_refuse_a_typo(name):
    read, message = SWITCHES[name]
    default = name == "HSPEC_SPECULATION_GUARD"
    assert read({}) is default and read({name: ""}) is default and read({name: "  "}) is default
    assert read({name: "1"}) is True and read({name: " 0 "}) is False
    for typo in ("yes1", "true", "on", "2"):
        with pytest.raises(ValueError) as err:
            read({name: typo})
        assert str(err.value) == message.replace("'yes1'", repr(typo))


def test_env_switch_reads_this_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("HSPEC_TEST_SWITCH", "1")
    assert env_switch("HSPEC_TEST_SWITCH", on="a", off="b") is True
    monkeypatch.setenv("HSPEC_TEST_SWITCH", "yes1")
    with pytest.raises(ValueError, match=r"^HSPEC_TEST_SWITCH='yes1': use 1 \(a\) or 0 \(b\); unset, it is 0$"):
        env_switch("HSPEC_TEST_SWITCH", on="a", off="b")


STEPS = ("HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS={raw!r}: expected an integer >= 1 (decode steps each probe measures at "
         "steady state), e.g. 16; unset, it is 16")
SECONDS = ("HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS={raw!r}: expected a finite number of seconds >= 0 (the least "
           "steady-state time each probe measures; 0: steps only), e.g. 2; unset, it is 2")


@pytest.mark.parametrize("name, raw, message", [
    ("HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS", "0", STEPS),
    ("HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS", "-3", STEPS),
    ("HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS", "1.5", STEPS),
    ("HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS", "many", STEPS),
    ("HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS", "nan", SECONDS),
    ("HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS", "inf", SECONDS),
    ("HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS", "-1", SECONDS),
    ("HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS", "soon", SECONDS),
])
def test_steady_state_settings_name_the_variable_and_range(name, raw, message):
    with pytest.raises(ValueError) as err:
        sps_cache.auto_profile_settings({name: raw})
    assert str(err.value) == message.format(raw=raw)


def test_steady_state_edges_are_accepted():
    assert sps_cache.auto_profile_settings({"HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS": "1",
                                            "HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "0"}) == \
        {"min_steady_steps": 1, "min_steady_seconds": 0.0}


def _server_args(tmp_path):
    return SimpleNamespace(model_path=str(tmp_path), speculative_draft_model_path=str(tmp_path), tp_size=1,
                           dtype="float32", device="cpu", base_gpu_id=0, speculative_dspark_sps_table_path=None)


@pytest.mark.parametrize("env, message", [
    ({"HSPEC_AUTO_PROFILE_SPS": "yes1"}, SWITCHES["HSPEC_AUTO_PROFILE_SPS"][1]),
    ({"HSPEC_SPS_PROFILING_SERVER": "yes1"}, SWITCHES["HSPEC_SPS_PROFILING_SERVER"][1]),
    ({"HSPEC_AUTO_PROFILE_SPS": "1", "HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS": "0"}, STEPS.format(raw="0")),
    ({"HSPEC_AUTO_PROFILE_SPS": "1", "HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "inf"}, SECONDS.format(raw="inf")),
], ids=["auto-profile-typo", "profiling-server-typo", "steady-steps-0", "steady-seconds-inf"])
def test_launch_stops_on_a_bad_value_before_profiling(tmp_path, monkeypatch, env, message):
    """The launcher's table decision refuses the value before any profiling server starts (a bad steady-state
    setting used to reach `profile_with_server` inside the try that logs a failure and serves without a
    table), and writes nothing to the cache."""
    monkeypatch.setenv("HSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sps_profile, "profile_with_server", lambda **_: pytest.fail("a profiling server started"))
    args = _server_args(tmp_path)
    with pytest.raises(ValueError) as err:
        sps_cache.resolve_sps_table(args, block_size=7, environ={"SGLANG_RAGGED_VERIFY_MODE": "compact", **env})
    assert str(err.value) == message
    assert args.speculative_dspark_sps_table_path is None
    assert not (tmp_path / "cache").exists()


# ---- HSPEC_STEP_PROFILE ----
def test_step_profile_is_written_at_startup(tmp_path):
    path = tmp_path / "profiles" / "steps.json"
    assert step_timer.step_profile_path({}) is None and step_timer.step_profile_path({"HSPEC_STEP_PROFILE": " "}) is None
    assert step_timer.step_profile_path({"HSPEC_STEP_PROFILE": str(path)}) == path
    assert json.loads(path.read_text()) == {"steps": {"draft": 0, "plain": 0}, "seconds": {"draft": {}, "plain": {}}}
    timer = step_timer.StepTimer.from_env({"HSPEC_STEP_PROFILE": str(path)})
    assert timer is not None and timer.path == path


def test_step_profile_under_a_file_names_the_variable_and_the_cause(tmp_path):
    (tmp_path / "afile").write_text("in the way\n")
    raw = str(tmp_path / "afile" / "sub" / "steps.json")
    with pytest.raises(ValueError) as err:
        step_timer.StepTimer.from_env({"HSPEC_STEP_PROFILE": raw})
    assert str(err.value) == (f"HSPEC_STEP_PROFILE={raw!r}: the step profile cannot be written: {tmp_path / 'afile'} "
                              "is a file, not a directory; set it to a writable .json file path, or unset it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert (tmp_path / "afile").read_text() == "in the way\n"


def test_step_profile_in_a_read_only_directory_names_the_cause(tmp_path):
    """A write that fails for another reason carries the atomic writer's cause (core/atomic.py)."""
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user writes anywhere (root): no permission to refuse")
        raw = str(ro / "steps.json")
        with pytest.raises(ValueError) as err:
            step_timer.step_profile_path({"HSPEC_STEP_PROFILE": raw})
        assert str(err.value).startswith(f"HSPEC_STEP_PROFILE={raw!r}: the step profile cannot be written (could "
                                         f"not write {raw}: Permission denied; the location is not writable.")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_step_profile_naming_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError) as err:
        step_timer.step_profile_path({"HSPEC_STEP_PROFILE": str(tmp_path)})
    assert str(err.value) == (f"HSPEC_STEP_PROFILE={str(tmp_path)!r} is a directory; set it to a writable .json "
                              f"file path, or unset it (e.g. {tmp_path / 'steps.json'})")
    assert list(tmp_path.iterdir()) == []


# ---- every variable at server-argument validation ----
@pytest.mark.parametrize("env, match", [
    ({"HSPEC_SPECULATION": "sometimes"}, "HSPEC_SPECULATION='sometimes' is not a speculation policy"),
    ({"HSPEC_SPECULATION_GUARD": "yes"}, "HSPEC_SPECULATION_GUARD='yes': use 1"),
    ({"HSPEC_PLAIN_STEP_FORWARD": "decode"}, "HSPEC_PLAIN_STEP_FORWARD='decode' is not a forward"),
    ({"HSPEC_LOOKUP": "2"}, "HSPEC_LOOKUP='2': use 1"),
    ({"HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES": "0,1"}, "HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES='0,1'"),
    ({"HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "nan"}, "HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS='nan'"),
], ids=["policy", "guard", "plain-forward", "lookup", "batch-sizes", "steady-seconds"])
def test_server_argument_validation_checks_every_variable_first(tmp_path, monkeypatch, env, match):
    """Variables only the worker reads (the guard, the plain-step forward), or that the chosen policy ignores,
    stop the launch at validation, before any checkpoint is read (the paths here hold none)."""
    from sglang_hspec.sglang_plugin import server_args

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        server_args.validate_server_args(SimpleNamespace(model_path=str(tmp_path / "none"),
                                                         speculative_draft_model_path=str(tmp_path / "none")))


def test_the_environment_check_accepts_the_defaults():
    from sglang_hspec.sglang_plugin.server_args import check_environment

    check_environment({})
    check_environment({"HSPEC_SPECULATION": "auto", "HSPEC_SPECULATION_GUARD": "0", "HSPEC_PLAIN_STEP_FORWARD": "verify"})
