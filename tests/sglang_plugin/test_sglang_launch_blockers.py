"""What stopped a first `launch_server --speculative-algorithm HSPEC` on a GPU, each reproduced under SGLang
0.5.23's own conditions on the CPU tier (docs/serving.md, "Launch checks"):

1. CUDA-graph capture of the draft forward with autograd on. SGLang's graph runner calls
   `model.forward(input_ids, positions, forward_batch)` as is (runner/decode_cuda_graph_runner.py
   `capture_one_shape`); SGLang's models carry `@torch.no_grad()` on their forward, and SGLang's own layers
   create parameters with requires_grad False. The drafter's nn.Linear parameters required grad, so a forward
   in grad mode took the Mamba training scan (mamba_ssm, absent in SGLang's environment: ScanUnavailableError).
   Here SGLang's Triton Mamba kernel runs under the Triton interpreter (HSPEC_MAMBA_SCAN=sglang forces the
   CUDA serving choice on CPU; the training branch refuses it with ScanUnavailableError).
2. `--dtype auto`: SGLang derives the drafter's dtype from the drafter's config.json alone
   (configs/model_config.py `_get_and_verify_dtype`: no dtype -> float32 -> float16), while the target's
   bf16 config gives a bf16 target and KV pool. A real CPU server with `--dtype auto` on the bf16 tiny target.
4. Qwen2 targets: SGLang's Qwen2ForCausalLM has no `set_dflash_layers_to_capture`, so the target runner's
   `configure_aux_hidden_state_capture` raised at startup. A real CPU server on a tiny Qwen2 target.

(3, tensor parallelism: the drafter's attention is sharded by KV head, tests/model/test_tensor_parallel.py and
test_sglang_tp.py; a TP size that splits a KV head is refused at argument validation, test_sglang_server_args.py
and test_sglang_startup_errors.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

TESTS_DIR = Path(__file__).resolve().parents[1]
MAX_NEW = 24
SPAWN = {"SGLANG_CPU_TESTING_FORK": "0"}  # children load both plugins themselves, as on GPU


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from sglang_cpu import builders

    root = tmp_path_factory.mktemp("launch_blockers")
    target = builders.build_tiny_target(root / "target")
    qwen2 = builders.build_tiny_target(root / "qwen2_target", family="qwen2")
    return {"target": target, "hspec": builders.build_hspec_draft(root / "hspec", target),
            "qwen2": qwen2, "qwen2_hspec": builders.build_hspec_draft(root / "qwen2_hspec", qwen2)}


# The draft model built and loaded as SGLang's loader does (model class from config.json through transformers'
# AutoConfig, load_weights, .eval()), the shared target modules with requires_grad False as SGLang's
# VocabParallelEmbedding / ParallelLMHead have them, a paged pool, and forward called in grad mode, as the
# graph runner calls it.
GRAPH_RUNNER_CALL = textwrap.dedent("""
    import contextlib, json, sys
    import torch
    torch.cpu.device = lambda index=None: contextlib.nullcontext()  # SGLang's launch wrapper (test_ssd_triton.py)
    sys.path.insert(0, sys.argv[1])
    from types import SimpleNamespace
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from sglang_cpu import builders
    from sglang_hspec.model import ssd
    from sglang_hspec.sglang_plugin.context import ContextState
    from sglang_hspec.sglang_plugin.draft_model import HSpecDraftModel

    target_dir, draft_dir = sys.argv[2], sys.argv[3]
    target = builders.load_target(target_dir)
    target.requires_grad_(False)  # SGLang's target layers hold parameters with requires_grad False
    model = HSpecDraftModel(AutoConfig.from_pretrained(draft_dir))
    model.load_weights(load_file(draft_dir + "/model.safetensors").items())
    model.attach_shared_modules(embed_tokens=target.get_input_embeddings(), lm_head=target.lm_head)
    model = model.eval()  # DefaultModelLoader.load_model returns model.eval()
    out = {"grad_enabled": torch.is_grad_enabled(),
           "params_requiring_grad": sorted(n for n, p in model.named_parameters() if p.requires_grad)[:5]}
    cfg = model.hspec_config
    t = cfg.target
    g = torch.Generator().manual_seed(0)
    slots, bs, k = 128, 3, cfg.block_size
    k_buf = [torch.randn(slots, t.num_key_value_heads, t.head_dim, generator=g) for _ in range(2)]
    v_buf = [torch.randn(slots, t.num_key_value_heads, t.head_dim, generator=g) for _ in range(2)]
    req_to_token = torch.randperm(slots - 1, generator=g)[:8 * 12].view(8, 12).to(torch.int32) + 1
    model.bind_target_kv(SimpleNamespace(get_key_buffer=lambda L: k_buf[L], get_value_buffer=lambda L: v_buf[L]),
                         req_to_token)
    state = ContextState(req_pool_size=8, rank=cfg.fusion_rank, project=model.project_context, device="cpu",
                         dtype=torch.float32)
    req = torch.tensor([5, 0, 3])
    state.write(req, torch.randn(bs, cfg.hidden_size, generator=g))  # the prefill capture's rows
    model.context_state = state
    out["context_requires_grad"] = state.buffer.requires_grad
    fb = SimpleNamespace(batch_size=bs, req_pool_indices=req, seq_lens=torch.tensor([9, 4, 11]))
    ids = torch.full((bs, k), cfg.mask_token_id)
    ids[:, 0] = torch.tensor([7, 70, 700])
    positions = (fb.seq_lens[:, None] + torch.arange(k)).reshape(-1)
    ssd.SCANS_RUN.clear()
    try:
        hidden = model.forward(ids.reshape(-1), positions, fb).hidden_states  # as capture_one_shape calls it
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    else:
        out.update(scans=sorted(ssd.SCANS_RUN), requires_grad=hidden.requires_grad, has_grad_fn=hidden.grad_fn is not None,
                   finite=bool(torch.isfinite(hidden).all()), shape=list(hidden.shape))
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_draft_forward_called_as_the_graph_runner_calls_it_runs_the_inference_scan_without_autograd(ckpts):
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HSPEC_MAMBA_SCAN="sglang",  # on CUDA `auto` picks this scan for inference and mamba_ssm under grad
               SGLANG_RAGGED_VERIFY_MODE="static",
               PYTHONPATH=os.pathsep.join([str(TESTS_DIR), str(TESTS_DIR.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", GRAPH_RUNNER_CALL, str(TESTS_DIR), str(ckpts["target"]),
                           str(ckpts["hspec"])], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT"):])
    assert res["grad_enabled"] is True  # the call really happened in grad mode
    assert "error" not in res, res["error"]
    assert res["scans"] == ["sglang"]  # SGLang's Triton inference kernel, not the training scan
    assert res["requires_grad"] is False and res["has_grad_fn"] is False  # no autograd graph was built
    assert res["finite"] and res["shape"] == [3 * 3, 128]
    assert res["params_requiring_grad"] == []  # as loaded: nothing in the drafter asks for gradients
    assert res["context_requires_grad"] is False  # the context rows written at prefill carry no graph either


def _greedy(srv, prompts):
    return [o["output_ids"] for o in srv.generate(prompts, MAX_NEW)]


@pytest.mark.slow
def test_dtype_auto_serves_the_drafter_in_the_targets_dtype(ckpts, sglang_server):
    """`--dtype auto` on the bf16 tiny target (its config.json says bfloat16) with a float32-saved drafter:
    the drafter loads in the target's dtype (bf16), not the float16 SGLang derives from the drafter's config
    alone, and the server serves. Output is checked against the same server without speculation (bf16 on both
    sides; greedy is lossless)."""
    from sglang_cpu import builders

    prompts = builders.PROMPTS[:3]
    plain = sglang_server(ckpts["target"], name="auto_plain", dtype="auto")
    expected = _greedy(plain, prompts)
    plain.stop()
    srv = sglang_server(ckpts["target"], name="auto_hspec", dtype="auto", plugins=("sglang_cpu_testing", "hspec"),
                        args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(ckpts["hspec"])],
                        env_extra=SPAWN)
    got = _greedy(srv, prompts)
    log = srv.log()
    # SGLang's own record of each runner's dtype: its KV-pool line (kv_cache_dtype auto = the model's dtype),
    # the target's pool (4,096 tokens) and the drafter runner's placeholder pool (64 tokens, worker.py)
    assert "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4096" in log, log[-3000:]
    assert "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 64," in log, log[-3000:]  # was float16
    assert "HSPEC: drafter dtype torch.bfloat16 (the target's; --dtype auto)" in log, log[-3000:]
    assert got == expected


@pytest.mark.slow
def test_qwen2_target_is_served(ckpts, sglang_server):
    """A Qwen2 target: SGLang 0.5.23's Qwen2ForCausalLM lacks the DFlash capture hook; the plugin adds it
    (sglang_plugin/hooks.py), so the target captures the drafter's layers and greedy output equals HF's."""
    from sglang_cpu import builders

    prompts = builders.PROMPTS[:3]
    expected = builders.hf_greedy(ckpts["qwen2"], prompts, MAX_NEW)
    srv = sglang_server(ckpts["qwen2"], name="qwen2_hspec", plugins=("sglang_cpu_testing", "hspec"),
                        args=["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path",
                              str(ckpts["qwen2_hspec"])], env_extra=SPAWN)
    got = _greedy(srv, prompts)
    log = srv.log()
    assert "HSPEC: Qwen2ForCausalLM captures target layers [0] for the drafter" in log, log[-3000:]
    assert got == expected
