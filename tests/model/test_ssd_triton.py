"""SGLang's Triton Mamba kernel (the CUDA serving path) run by Triton's interpreter on CPU: the block scan
equals the token recurrence from a non-zero state, leaves the state unwritten, and a whole drafter
forward through the dispatcher (HSPEC_MAMBA_SCAN=sglang) gives the torch scan's logits and tokens.

Runs where SGLang and Triton are installed (the SGLang tier, .venv-sglang). TRITON_INTERPRET must be set
before Triton decorates the kernels, so the checks run in a fresh interpreter. The one shim: SGLang
enters `torch.get_device_module(x.device).device(index)` around the launch, and torch.cpu has no
`device` context manager (a no-op on CPU)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None or importlib.util.find_spec("triton") is None,
    reason="needs SGLang and Triton (the SGLang tier: .venv-sglang/bin/python -m pytest tests/model)")

SCRIPT = textwrap.dedent("""
    import contextlib, json, sys
    import torch
    torch.cpu.device = lambda index=None: contextlib.nullcontext()
    sys.path.insert(0, sys.argv[1])
    from sglang_hspec.model import ssd
    from sglang_hspec.core.types import DraftContext, SamplingParams
    from sglang_hspec.target.kv_view import dense_window_view
    from model._tiny import make_drafter, make_target, target_features

    def rel(a, b):
        return float((a.double() - b.double()).abs().max() / b.double().abs().max())

    out = {"scan": {}}
    for (b, L, h, p, n, g) in [(3, 7, 8, 16, 4, 4), (2, 8, 4, 8, 16, 1), (1, 1, 4, 8, 4, 2)]:
        gen = torch.Generator().manual_seed(b * 100 + L)
        r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
        x, B, C, dt = r(b, L, h, p), r(b, L, g, n), r(b, L, g, n), r(b, L, h) - 1
        A, D, dt_bias, s0 = -torch.exp(r(h) * 0.5), r(h), r(h) * 0.5, r(b, h, p, n)
        y_ref, _ = ssd.ssd_naive(x, torch.nn.functional.softplus(dt + dt_bias), A, B, C, D, s0)
        state = s0.float()
        y = ssd.sglang_block_scan(*(t.float() for t in (x, dt, A, B, C, D, dt_bias)), state)
        out["scan"][f"{b}x{L}x{h}x{p}x{n}x{g}"] = {"rel": rel(y, y_ref), "state_kept": torch.equal(state, s0.float())}

    target = make_target("qwen3", dtype=torch.float32)
    drafter = make_drafter("hspec", target)
    ids = torch.randint(4, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, ids)
    n = torch.tensor([11, 19])
    ctx = DraftContext(anchor_tokens=ids[:, 5], last_position=n, target_hidden=feats.hidden[torch.arange(2), n],
                       kv_views={l: dense_window_view(*feats.kv[l], n, drafter.sliding_window)
                                 for l in drafter.kv_layer_ids})
    props, hs = {}, {}
    for backend in ("torch", "sglang"):
        import os
        os.environ[ssd.SCAN_ENV] = backend
        ssd.SCANS_RUN.clear()
        with torch.no_grad():
            hs[backend] = drafter.backbone(ctx.anchor_tokens, n, ctx.target_hidden, drafter.propose_contexts(ctx))
            props[backend] = drafter.propose(ctx, SamplingParams())
        out[f"ran_{backend}"] = sorted(ssd.SCANS_RUN)
    out["hidden_rel"] = rel(hs["sglang"], hs["torch"])
    out["same_tokens"] = torch.equal(props["sglang"].tokens, props["torch"].tokens)
    print("RESULT" + json.dumps(out))
""")


def test_sglang_triton_kernel_under_the_interpreter():
    tests_dir = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(tests_dir), str(tests_dir.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("HSPEC_MAMBA_SCAN", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tests_dir.parent)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT"):])
    for shape, r in res["scan"].items():
        assert r["rel"] < 1e-5, (shape, r)  # fp32 kernel vs float64 recurrence
        assert r["state_kept"], shape  # disable_state_update: the initial state is only read
    assert res["ran_torch"] == ["torch"] and res["ran_sglang"] == ["sglang"]
    assert res["hidden_rel"] < 1e-4 and res["same_tokens"]
