"""GPU parity checks (run by scripts/gpu_check.sh): CPU float64 reference vs CUDA fp32 (TF32 off) and bf16.

1. SSD scan: mamba_chunk_scan_combined(initial_states=...) vs ssd_block in float64, shapes from
   mamba2.md §8: outputs, final state and gradients of x, dt, A, B, C, D, dt_bias, initial_states.
2. Whole H-Spec drafter (teacher-forced forward over many anchors): same weights on CPU float64 and on
   CUDA (Triton scan + fused SDPA): logits, confidence logits and parameter gradients.
3. Planner: `topk_lengths` (an HSPEC server's per-request verify lengths, sglang_plugin/planner_hooks.py)
   on CUDA gives the CPU's lengths without a host synchronisation (torch.cuda sync debug mode "error").
Writes gpu_check.json under --out; exit status 1 when a check exceeds its tolerance, 0 when it passes
or when CUDA is absent (reported as skipped)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_hspec.model.ssd import gpu_scan, ssd_block  # noqa: E402

TOL = {"fp32": (1e-4, 1e-3), "bf16": (5e-2, 1.5e-1)}  # (outputs/state, gradients), relative to max |ref|


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def ssd_case(scan, b, L, h, p, n, g, chunk, dtype):
    gen = torch.Generator().manual_seed(b * 1000 + L)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, B, C, dt = r(b, L, h, p), r(b, L, g, n), r(b, L, g, n), r(b, L, h) - 1
    A, D, dt_bias, s0 = -torch.exp(r(h) * 0.5), r(h), r(h) * 0.5, r(b, h, p, n)
    gy, gs = r(b, L, h, p), r(b, h, p, n)
    cpu = [t.clone().requires_grad_(True) for t in (x, dt, A, B, C, D, dt_bias, s0)]
    y, s = ssd_block(cpu[0], F.softplus(cpu[1] + cpu[6]), cpu[2], cpu[3], cpu[4], cpu[5], cpu[7])
    ((y * gy).sum() + (s * gs).sum()).backward()
    act = torch.float32 if dtype == "fp32" else torch.bfloat16
    gpu = [t.to("cuda", act if i in (0, 1, 3, 4) else torch.float32).detach().requires_grad_(True)
           for i, t in enumerate((x, dt, A, B, C, D, dt_bias, s0))]
    yg, sg = scan(gpu[0], gpu[1], gpu[2], gpu[3], gpu[4], chunk, D=gpu[5], dt_bias=gpu[6], dt_softplus=True,
                  initial_states=gpu[7], return_final_states=True)
    ((yg.float() * gy.cuda().float()).sum() + (sg.float() * gs.cuda().float()).sum()).backward()
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")
    res = {"y": rel(yg, y), "final_state": rel(sg, s)}
    res.update({f"grad_{nm}": rel(gg.grad, gc.grad) for nm, gg, gc in zip(names, gpu, cpu)})
    return res


def drafter_case(dtype, device="cuda"):
    from sglang_hspec.assets.tiny import tiny_target
    from sglang_hspec.model import HSpecConfig, build_drafter
    from sglang_hspec.target.geometry import TargetGeometry
    from sglang_hspec.target.hf_compat import forward_with_kv

    target = tiny_target("qwen3", seed=0, dtype=torch.float64, hidden_size=256, num_layers=6, num_heads=8,
                         num_kv_heads=2, head_dim=32, vocab_size=512, intermediate_size=512)
    ids = torch.randint(4, 512, (4, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the machine's transformers may name the cache argument either way
        out, kv = forward_with_kv(target, kv_layer_ids=range(6), input_ids=ids, output_hidden_states=True)
    cfg = HSpecConfig(target=TargetGeometry.from_hf_config(target.config), target_layer_ids=(0, 1, 2, 3, 5),
                      mask_token_id=3, intermediate_size=512, mamba_num_heads=8, draft_vocab_size=400,
                      markov_rank=32, sliding_window=48)
    torch.manual_seed(1)
    model = build_drafter("hspec", cfg, target.model.embed_tokens, target.lm_head).double()

    class Feats:
        pass

    def feats(dev, dt):
        f = Feats()
        f.hidden = torch.stack(out.hidden_states[1:], 2)[:, :, list(cfg.target_layer_ids)].to(dev, dt)
        f.kv = {i: (k.to(dev, dt), v.to(dev, dt)) for i, (k, v) in kv.items()}
        return f

    anchors = torch.tensor([[5, 30, 60, 88]] * 4)
    ref = model.forward_train(feats("cpu", torch.float64), ids, anchors)
    (ref.logits.square().mean() + ref.confidence_logits.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    act = torch.float32 if dtype == "fp32" else torch.bfloat16
    embed = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.to(device, act))
    lm = torch.nn.Linear(256, 512, bias=False).to(device, act)
    lm.weight.data.copy_(target.lm_head.weight.to(act))
    gmodel = build_drafter("hspec", cfg, embed, lm).to(device, act)
    gmodel.load_state_dict(model.state_dict())
    res = gmodel.forward_train(feats(device, act), ids.to(device), anchors.to(device))
    (res.logits.float().square().mean() + res.confidence_logits.float().sum()).backward()
    worst = max(((n, rel(p.grad, ref_grads[n])) for n, p in gmodel.named_parameters()), key=lambda t: t[1])
    return {"logits": rel(res.logits, ref.logits), "confidence": rel(res.confidence_logits, ref.confidence_logits),
            "worst_grad": worst[1], "worst_grad_param": worst[0],
            "triton_scan_used": gpu_scan() is not None}


def planner_case(device="cuda"):
    from sglang_hspec.scheduler import planner

    gen = torch.Generator().manual_seed(0)
    mismatches = cases = 0
    for n in (1, 7, 48, 256):
        for k in (3, 7):
            conf = torch.rand(n, k, generator=gen)
            conf[torch.rand(n, k, generator=gen) < 0.2] = 0.5  # exact ties
            conf[torch.rand(n, k, generator=gen) < 0.05] = 1e-7  # under SGLang's survival_eps
            surv = torch.cumprod(conf, 1)
            dev = surv.to(device)
            for budget in (0, 1, n, n * k // 2, n * k + 3):
                want = planner.topk_lengths(survival=surv, budget=budget, min_survival=1e-6)
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")  # any host read-back raises
                try:
                    got = planner.topk_lengths(survival=dev, budget=budget, min_survival=1e-6)
                finally:
                    if device == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
                mismatches += int(not torch.equal(got.cpu(), want))
                cases += 1
    return {"fp32_topk_mismatched_cases": float(mismatches), "cases": cases}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check_out"))
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the drafter check fp32 on CPU (script test)")
    args = ap.parse_args()
    if args.cpu_dry_run:
        print("drafter_fp32_cpu", drafter_case("fp32", device="cpu"))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"cuda": torch.cuda.is_available(), "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
              "torch": torch.__version__, "checks": {}, "failures": []}
    if not torch.cuda.is_available():
        report["skipped"] = "no CUDA device"
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print("gpu_check: skipped (no CUDA device)")
        return 0
    report["device"] = torch.cuda.get_device_name()
    scan = gpu_scan()
    report["mamba_ssm"] = scan is not None
    t0 = time.time()
    shapes = [(4, 8, 48, 64, 4, 4, 256), (128, 16, 48, 64, 4, 4, 256), (4, 8, 48, 64, 4, 4, 16),
              (3, 12, 8, 64, 16, 1, 256), (2, 1, 48, 64, 4, 4, 256), (2, 40, 8, 64, 16, 2, 16)]
    for dtype in ("fp32", "bf16"):
        if scan is not None:
            for shp in shapes:
                name = f"ssd_{dtype}_" + "x".join(map(str, shp))
                try:
                    report["checks"][name] = r = ssd_case(scan, *shp, dtype)
                except Exception as e:  # noqa: BLE001 - record and continue: one shape must not hide the rest
                    report["checks"][name] = r = {"error": repr(e)}
                print(name, r, flush=True)
        try:
            report["checks"][f"drafter_{dtype}"] = r = drafter_case(dtype)
        except Exception as e:  # noqa: BLE001
            report["checks"][f"drafter_{dtype}"] = r = {"error": repr(e)}
        print(f"drafter_{dtype}", r, flush=True)
    try:
        report["checks"]["planner_topk_fp32"] = r = planner_case()
    except Exception as e:  # noqa: BLE001
        report["checks"]["planner_topk_fp32"] = r = {"error": repr(e)}
    print("planner_topk_fp32", r, flush=True)
    for name, r in report["checks"].items():
        dtype = "fp32" if "fp32" in name else "bf16"
        out_tol, grad_tol = TOL[dtype]
        if "error" in r:
            report["failures"].append(f"{name}: {r['error']}")
            continue
        for key, v in r.items():
            if isinstance(v, float) and v > (grad_tol if "grad" in key else out_tol):
                report["failures"].append(f"{name}.{key} = {v:.2e}")
    report["seconds"] = round(time.time() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print("FAILURES:" if report["failures"] else "all GPU checks passed", *report["failures"], sep="\n  ")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
