"""What a user sees when `python -m sglang.launch_server --speculative-algorithm HSPEC` cannot serve: the
real launcher (subprocess, CPU tier environment) exits non-zero during server-argument resolution, before
any weights load or any scheduler starts, and the last line it prints names the problem and the fix.

The unit tier (test_sglang_server_args.py, test_sglang_registration.py) checks the messages themselves;
here the launcher runs end to end: HSPEC's checks run as a resolution hook ahead of SGLang's own
speculative handling (sglang_plugin/server_args.py `launch_checks`), so SGLang never reaches its own
reading of the drafter (a transformers hub error) or "Unknown speculative algorithm name: HSPEC".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_DRAFTER = REPO / "sglang_hspec" / "checkpoints" / "hspec-smollm2"
# Importing SGLang alone takes ~15 s on the 2-core CI machine (more when it is loaded); a failure after
# weight loading would also print the lines checked below.
EXIT_WITHIN_S = 240
BOTH_PLUGINS = ("sglang_cpu_testing", "hspec")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The tiny Qwen3 target, an H-Spec drafter built for it, and one whose config says it was built for a
    target with 4 KV heads instead of 2 (everything else equal)."""
    from sglang_cpu import builders

    root = tmp_path_factory.mktemp("startup_errors")
    target = builders.build_tiny_target(root / "target")
    drafter = builders.build_hspec_draft(root / "hspec", target)
    other = root / "hspec_kv4"
    shutil.copytree(drafter, other)
    raw = json.loads((other / "config.json").read_text())
    raw["hspec"]["target"]["num_key_value_heads"] = 4
    (other / "config.json").write_text(json.dumps(raw, indent=2))
    return {"target": target, "hspec": drafter, "hspec_kv4": other, "root": root}


def launch_and_fail(target: Path, args: list[str], *, plugins=BOTH_PLUGINS, pythonpath_extra: Path | None = None,
                    env_extra: dict[str, str] | None = None, log: Path) -> tuple[int, str, float]:
    """Run the real launcher as the CPU tier does (tests/sglang_cpu/server.py: a fork of its zygote, which
    has imported the third-party packages but not sglang), expecting it to stop on its own: (exit code,
    output, seconds). Never leaves a process behind."""
    from sglang_cpu import server as cpu_server

    env = {**cpu_server.cpu_env(plugins=plugins), **(env_extra or {})}
    if pythonpath_extra is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath_extra), env["PYTHONPATH"]])
    argv = ["--model-path", str(target), "--device", "cpu", "--host", "127.0.0.1", "--port",
            str(cpu_server.free_port()), "--max-total-tokens", "4096", "--skip-server-warmup", "--disable-cuda-graph",
            "--dtype", "float32", "--speculative-algorithm", "HSPEC", *args]
    t0 = time.monotonic()
    proc = cpu_server.start_launcher(argv, env=env, log_path=log)
    try:
        rc = proc.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a server that came up, or stragglers
        except ProcessLookupError:
            pass
        proc.wait()
    elapsed = time.monotonic() - t0
    out = log.read_text(errors="replace")
    assert rc is not None, f"the launcher was still running after {EXIT_WITHIN_S} s:\n{out[-4000:]}"
    return rc, out, elapsed


def last_line(out: str) -> str:
    return [line for line in out.splitlines() if line.strip()][-1]


def assert_stopped_at_argument_resolution(rc: int, out: str) -> None:
    assert rc != 0, out[-4000:]
    # The launcher logs `server_args=...` once resolution is done, then starts the scheduler, which
    # loads the weights: neither happened.
    assert "server_args=" not in out and "Load weight" not in out, out[-4000:]
    assert "run_resolution_pipeline" in out  # the traceback comes from argument resolution in the launcher
    # SGLang's own reading of the drafter never ran (its failure there is a transformers hub error)
    assert "Repo id must be in the form" not in out and "Unknown speculative algorithm" not in out


def test_drafter_built_for_another_model_family(ckpts, tmp_path):
    """The shipped SmolLM2-135M drafter against the tiny Qwen3 target."""
    rc, out, elapsed = launch_and_fail(ckpts["target"], ["--speculative-draft-model-path", str(SMOLLM2_DRAFTER)],
                                       log=tmp_path / "launch.log")
    assert_stopped_at_argument_resolution(rc, out)
    line = last_line(out)
    assert line.startswith("ValueError: the HSPEC drafter"), line
    assert f"{SMOLLM2_DRAFTER} was built for another target than --model-path {ckpts['target']}" in line
    for field in ("target.model_type: checkpoint 'llama' vs target 'qwen3'",
                  "target.num_hidden_layers: checkpoint 30 vs target 2",
                  "target.hidden_size: checkpoint 576 vs target 128",
                  "target.num_key_value_heads: checkpoint 3 vs target 2",
                  "target.vocab_size: checkpoint 49152 vs target 1024"):
        assert field in line, field
    # each out-of-range capture/KV layer id once, in order
    assert line.count("target_layer_ids: checkpoint 28 vs target '< 2'") == 1
    assert "Load the drafter trained for this target (or retrain it)" in line
    print(f"\nmismatched drafter: exit {rc} after {elapsed:.1f} s\n{line}")


def test_drafter_whose_geometry_differs_in_one_field(ckpts, tmp_path):
    rc, out, _ = launch_and_fail(ckpts["target"], ["--speculative-draft-model-path", str(ckpts["hspec_kv4"])],
                                 log=tmp_path / "launch.log")
    assert_stopped_at_argument_resolution(rc, out)
    line = last_line(out)
    details = line.split("does not match the target: ", 1)[1]
    # exactly the one field, with both values, then the fix
    assert details == ("target.num_key_value_heads: checkpoint 4 vs target 2. "
                       "Load the drafter trained for this target (or retrain it)."), line


def test_draft_model_path_that_does_not_exist(ckpts, tmp_path):
    missing = ckpts["root"] / "no_such_drafter"
    rc, out, elapsed = launch_and_fail(ckpts["target"], ["--speculative-draft-model-path", str(missing)],
                                       log=tmp_path / "launch.log")
    assert_stopped_at_argument_resolution(rc, out)
    line = last_line(out)
    assert line == (f"ValueError: --speculative-draft-model-path {missing} does not exist (neither a local "
                    "checkpoint directory nor a cached hub model); pass an existing checkpoint directory "
                    "(config.json and model.safetensors)"), line
    print(f"\nmissing drafter: exit {rc} after {elapsed:.1f} s\n{line}")


def test_draft_model_path_not_given(ckpts, tmp_path):
    rc, out, _ = launch_and_fail(ckpts["target"], [], log=tmp_path / "launch.log")
    assert_stopped_at_argument_resolution(rc, out)
    assert last_line(out) == ("ValueError: --speculative-algorithm HSPEC requires --speculative-draft-model-path "
                              "<H-Spec drafter checkpoint>")


def test_lookup_splice_with_overlap_scheduling(ckpts, tmp_path):
    """HSPEC_LOOKUP=1 reads the host's token history, stale by a step under overlap scheduling (the default)."""
    rc, out, _ = launch_and_fail(ckpts["target"], ["--speculative-draft-model-path", str(ckpts["hspec"])],
                                 env_extra={"HSPEC_LOOKUP": "1"}, log=tmp_path / "launch.log")
    assert_stopped_at_argument_resolution(rc, out)
    assert last_line(out) == ("ValueError: HSPEC_LOOKUP=1 reads each request's token history on the host, which "
                              "under overlap scheduling lags the device by one step: launch with "
                              "--disable-overlap-schedule, or drop HSPEC_LOOKUP")


def test_tensor_parallelism_that_splits_a_kv_head(ckpts, tmp_path):
    """`--tp 4` over the target's 2 KV heads: refused while the launcher resolves its arguments, naming the
    flag and both numbers (each rank's drafter reads whole KV heads of its pool)."""
    rc, out, _ = launch_and_fail(ckpts["target"], ["--speculative-draft-model-path", str(ckpts["hspec"]),
                                                   "--tp", "4"], log=tmp_path / "launch.log")
    assert_stopped_at_argument_resolution(rc, out)
    line = last_line(out)
    assert "--tp-size 4" in line and "2 KV heads, which 4 does not divide" in line, line


def fake_installed_version(root: Path, dist: str, version: str) -> Path:
    """A directory that, first on PYTHONPATH, makes importlib.metadata report `dist` at `version` in
    every process of the launch (launcher, and the scheduler if it got that far), while the code that
    runs is still the installed SGLang: what the plugin sees when another release is installed. Nothing
    in site-packages changes."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return root


@pytest.mark.parametrize("dist,version,expected", [
    ("sglang", "0.5.22",
     "RuntimeError: the HSPEC plugin supports sglang==0.5.23 only (it subclasses private DSpark internals), "
     "found sglang 0.5.22; pip install sglang==0.5.23"),
    ("sglang-kernel", "0.4.11",
     "RuntimeError: sglang 0.5.23 pins sglang-kernel==0.4.10, found 0.4.11; pip install sglang-kernel==0.4.10"),
])
def test_wrong_sglang_release(ckpts, tmp_path, dist, version, expected):
    """register() refuses another release; SGLang's plugin loader only logs that, so the launcher used to
    end with "Unknown speculative algorithm name: HSPEC". The launch checks installed before the version
    check repeat it where HSPEC is asked for. Only the hspec plugin is loaded: the CPU tier plugin checks
    the version too, and its message is not the user's."""
    fake = fake_installed_version(tmp_path / "site", dist, version)
    rc, out, elapsed = launch_and_fail(ckpts["target"], ["--speculative-draft-model-path", str(ckpts["hspec"])],
                                       plugins=("hspec",), pythonpath_extra=fake, log=tmp_path / "launch.log")
    assert_stopped_at_argument_resolution(rc, out)
    assert "Failed to execute general plugin: hspec" in out  # SGLang's loader logged register()'s error first
    assert last_line(out) == expected
    print(f"\n{dist} {version}: exit {rc} after {elapsed:.1f} s\n{last_line(out)}")
