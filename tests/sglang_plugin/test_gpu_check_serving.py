"""scripts/gpu_check.{sh,py}'s serving-path checks, the parts a CPU can run: `--dry-run` (the paged Triton kernel on
SGLang-layout pools under Triton's interpreter, HSpecDraftModel.forward in grad mode) passes and lists the CUDA-only
checks as not run; the draft-model check runs with SGLang stand-ins where SGLang is absent (the lent GPU machine);
and the verdict fails a forward that builds an autograd graph or keeps parameters that require grad."""

from __future__ import annotations

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
    spec = importlib.util.spec_from_file_location("gpu_check_serving", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the dry run needs Triton (.venv-sglang)")
def test_dry_run_passes_and_names_what_only_a_gpu_runs(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["failures"] == []
    assert report["versions"]["torch"] and report["versions"]["triton"]  # printed and recorded
    assert "gpu_check: versions" in proc.stdout
    checks = report["checks"]
    for page in (1, 16):
        for kv in ("bf16", "fp8"):
            r = checks[f"paged_attention_bf16_kv{kv}_page{page}"]
            assert r["out"] < 2e-2 and r["non_finite"] == 0.0, r  # bf16 queries against the float64 twin
    fwd = checks["draft_model_forward_bf16"]
    assert fwd["grad_mode_off"] == 0.0 and fwd["autograd_graph_built"] == 0.0 and fwd["params_requiring_grad"] == 0.0
    assert fwd["hidden_vs_float64"] < 5e-2 and fwd["scans_run"] == ["torch"]
    assert {"draft_model_graph_bf16", "readback_no_sync", "cuda_graph_propose_fp32"} <= set(report["not_run"])


def test_draft_model_check_runs_with_sglang_stand_ins_where_sglang_is_absent(tmp_path):
    """The GPU machine has no SGLang: the check imports draft_model.py through stand-ins and still runs the
    real forward (here on CPU, eager, in a fresh interpreter without SGLang on its path)."""
    code = ("import sys, json; sys.argv = ['x']; sys.path.insert(0, 'scripts')\n"
            "import importlib.abc\n"
            "class NoSGLang(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'sglang' or name.startswith('sglang.'):\n"
            "            raise ImportError('SGLang hidden for this test')\n"
            "sys.meta_path.insert(0, NoSGLang())\n"
            "import gpu_check\n"
            "r = gpu_check.draft_model_graph_case({}, device='cpu', capture=False)\n"
            "print('RESULT' + json.dumps(r))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT"):])
    assert r["sglang_stand_ins"] is True
    assert r["autograd_graph_built"] == 0.0 and r["params_requiring_grad"] == 0.0 and r["hidden_vs_float64"] < 5e-2


def test_verdict_fails_an_autograd_graph_and_trainable_weights(gpu_check):
    ok = {"grad_mode_off": 0.0, "params_requiring_grad": 0.0, "autograd_graph_built": 0.0, "context_rows_require_grad": 0.0,
          "hidden_vs_float64": 0.01, "replay_vs_eager": 0.0, "replay_autograd_graph_built": 0.0,
          "scans_run": ["sglang"], "expected_scan": "sglang", "sglang_stand_ins": True}
    assert gpu_check.failures_of({"draft_model_graph_bf16": ok}) == []
    for key in ("grad_mode_off", "params_requiring_grad", "autograd_graph_built", "context_rows_require_grad",
                "replay_autograd_graph_built"):
        bad = gpu_check.failures_of({"draft_model_graph_bf16": {**ok, key: 1.0}})
        assert bad == [f"draft_model_graph_bf16.{key} = 1.00e+00 (limit 0e+00)"], (key, bad)
    assert gpu_check.failures_of({"draft_model_graph_bf16": {**ok, "scans_run": ["mamba_ssm"]}}) == [
        "draft_model_graph_bf16: expected the sglang Mamba scan, ran ['mamba_ssm']"]
    assert gpu_check.failures_of({"paged_attention_bf16_kvfp8_page16": {"out": 0.01, "non_finite": 0.0,
                                                                       "auto_vs_kernel_mismatch": 1.0}}) == [
        "paged_attention_bf16_kvfp8_page16.auto_vs_kernel_mismatch = 1.00e+00 (limit 0e+00)"]
