"""scripts/gpu_check.{sh,py}, the CPU-side logic: a CPU-only run fails loudly (never "passes" without a
kernel), and the verdict fails every way a GPU check can go wrong, including a kernel that did not run."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_only_run_fails_with_a_clear_message(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: FAIL: no CUDA device visible to torch" in proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["cuda"] is False and report["failures"] and report["checks"] == {}


def test_verdict_passes_only_clean_checks(gpu_check):
    clean = {"kernel_sglang_installed": {}, "ssd_sglang_fp32_4x7": {"y": 3e-6, "state_written": 0.0},
             "drafter_propose_bf16": {"hidden": 1e-2, "greedy_token_mismatch": 0.1, "scans_run": ["sglang"],
                                      "expected_scan": "sglang"},
             "drafter_train_fp32": {"logits": 1e-5, "worst_grad": 5e-4, "scans_run": ["mamba_ssm"],
                                    "expected_scan": "mamba_ssm"}}
    assert gpu_check.failures_of(clean) == []


@pytest.mark.parametrize("name,result,expect", [
    ("kernel_mamba_ssm_installed", {"error": "not importable (No module named 'mamba_ssm')"}, "not importable"),
    ("ssd_sglang_fp32_4x7", {"y": 2e-4, "state_written": 0.0}, "y = 2.00e-04"),
    ("ssd_sglang_bf16_4x7", {"y": 1e-2, "state_written": 1.0}, "state_written"),
    ("drafter_train_fp32", {"worst_grad": 2e-3, "scans_run": ["mamba_ssm"], "expected_scan": "mamba_ssm"},
     "worst_grad"),
    ("drafter_propose_fp32", {"greedy_token_mismatch": 0.05, "scans_run": ["sglang"], "expected_scan": "sglang"},
     "greedy_token_mismatch"),
    ("drafter_propose_fp32", {"hidden": 1e-6, "scans_run": ["torch"], "expected_scan": "sglang"},
     "expected the sglang Mamba scan, ran ['torch']"),
    ("cuda_graph_propose_fp32", {"replay_token_mismatch": 0.0, "scans_run": [], "expected_scan": "mamba_ssm"},
     "expected the mamba_ssm Mamba scan"),
    ("continuous_decoder_fp64", {"greedy_reply_mismatch": 1 / 12, "sampled_rerun_mismatch": 0.0, "tokens": 280},
     "greedy_reply_mismatch = 8.33e-02"),
])
def test_verdict_fails_each_way_a_check_goes_wrong(gpu_check, name, result, expect):
    failures = gpu_check.failures_of({name: result})
    assert len(failures) == 1 and expect in failures[0] and failures[0].startswith(name)


def test_missing_kernels_fail_their_items(gpu_check, monkeypatch):
    from sglang_hspec.model import ssd

    monkeypatch.setattr(ssd, "_KERNELS", {"sglang": ImportError("No module named 'sglang'"), "mamba_ssm": object()})
    available, checks = gpu_check.kernel_availability()
    assert available == {"sglang": False, "mamba_ssm": True}
    assert gpu_check.failures_of(checks) == [
        "kernel_sglang_installed: not importable (No module named 'sglang'); install sglang-hspec[sglang] "
        "(sglang==0.5.23) on this machine"]
    assert gpu_check.expected_inference_scan(available) == "mamba_ssm"


@pytest.mark.slow
def test_drafter_checks_run_on_cpu(gpu_check):
    """The GPU machine has one try: the drafter checks' code runs here on CPU (fp32 vs float64, torch scan)."""
    prop = gpu_check.drafter_propose_case("fp32", {"sglang": True}, device="cpu")
    assert prop["hidden"] < 1e-4 and prop["greedy_token_mismatch"] == 0.0 and prop["scans_run"] == ["torch"]
    assert gpu_check.failures_of({"drafter_propose_fp32": prop}) == [
        "drafter_propose_fp32: expected the sglang Mamba scan, ran ['torch']"]
    train = gpu_check.drafter_train_case("fp32", device="cpu")
    assert train["logits"] < 1e-4 and train["worst_grad"] < 1e-3 and train["scans_run"] == ["torch"]


def test_continuous_decoder_check_runs_on_cpu(gpu_check):
    """The regeneration check's code, CPU against CPU: nothing differs, and replies of both lengths were drawn."""
    res = gpu_check.continuous_decoder_case(device="cpu")
    assert res["greedy_reply_mismatch"] == 0.0 and res["sampled_rerun_mismatch"] == 0.0
    assert 12 < res["tokens"] < 12 * 24  # some replies end at EOS before max_new_tokens
    assert gpu_check.failures_of({"continuous_decoder_fp64": res}) == []


def test_smallest_configs_keeps_the_least_shared_memory(gpu_check):
    """--autotune smallest: the 3 configs of least stages x tile, so the autotuner can still skip one that does
    not fit (on the H200 the single smallest by stages, then tile, did not)."""
    from types import SimpleNamespace

    def cfg(m, n, k, stages, warps):
        return SimpleNamespace(kwargs={"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "HAS_Z": True},
                               num_stages=stages, num_warps=warps)
    configs = [cfg(128, 256, 64, 3, 8), cfg(64, 32, 32, 5, 2), cfg(32, 64, 32, 5, 2), cfg(64, 64, 32, 4, 2),
               cfg(32, 32, 32, 2, 4), cfg(128, 32, 32, 4, 4)]
    # footprints: 6291456, 327680, 327680, 524288, 65536, 524288 (ties broken by fewer warps, then list order)
    kept = gpu_check.smallest_configs(configs)
    assert kept == [configs[4], configs[1], configs[2]]
    assert gpu_check.smallest_configs(configs, keep=1) == [configs[4]]
