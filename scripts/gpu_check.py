"""GPU checks (run by scripts/gpu_check.sh): CUDA kernels and the drafter against the CPU float64 reference.

Every check records which Mamba scan ran (sglang_hspec.model.ssd.SCANS_RUN) and fails when the kernel it
is meant to exercise did not run, was not installed, or raised:
1. kernels: SGLang's Triton `selective_state_update` (the serving scan) and mamba_ssm's
   `mamba_chunk_scan_combined` (the training scan) importable; a missing one fails its item.
2. SSD parity, each kernel vs `ssd_block` in float64 (fp32 with TF32 off, and bf16): outputs (SGLang:
   forward only, initial state left unwritten) and, for mamba_ssm, the gradients of every input.
3. Whole drafter: teacher-forced forward + backward (training: must run mamba_ssm) and `propose`
   (inference: must run SGLang's kernel where SGLang is installed), same weights as a CPU float64 copy.
4. CUDA graph: `propose` captured in a CUDA graph (any host sync or host-to-device copy raises during
   capture), replayed on new inputs, equal to the eager result.
5. Planner: `topk_lengths` on CUDA gives the CPU's lengths without a host sync (sync debug mode "error").
Writes gpu_check.json under --out. Exit status: 0 all passed, 1 a check failed, 2 no CUDA device."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))  # an installed sglang_hspec (gpu_check.sh) goes first
from sglang_hspec.model import ssd  # noqa: E402

TOL = {"fp32": (1e-4, 1e-3), "bf16": (5e-2, 1.5e-1)}  # (outputs/state, gradients), relative to max |ref|
SSD_SHAPES = [(4, 7, 48, 64, 4, 4, 256), (4, 8, 48, 64, 4, 4, 256), (128, 16, 48, 64, 4, 4, 256),
              (4, 8, 48, 64, 4, 4, 16), (3, 12, 8, 64, 16, 1, 256), (2, 1, 48, 64, 4, 4, 256),
              (2, 40, 8, 64, 16, 2, 16)]  # (b, L, h, p, n, g, chunk)
NO_CUDA_EXIT = 2


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _ssd_inputs(b, L, h, p, n, g):
    gen = torch.Generator().manual_seed(b * 1000 + L)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, B, C, dt = r(b, L, h, p), r(b, L, g, n), r(b, L, g, n), r(b, L, h) - 1
    return [x, dt, -torch.exp(r(h) * 0.5), B, C, r(h), r(h) * 0.5, r(b, h, p, n)]


def _on_gpu(tensors, dtype, grad=False):
    act = torch.float32 if dtype == "fp32" else torch.bfloat16  # x, dt, B, C in the activation dtype
    out = [t.detach().to("cuda", act if i in (0, 1, 3, 4) else torch.float32) for i, t in enumerate(tensors)]
    return [t.requires_grad_(True) for t in out] if grad else out


def ssd_sglang_case(b, L, h, p, n, g, chunk, dtype):
    x, dt, A, B, C, D, dt_bias, s0 = _ssd_inputs(b, L, h, p, n, g)
    y, _ = ssd.ssd_block(x, F.softplus(dt + dt_bias), A, B, C, D, s0)
    gpu = _on_gpu([x, dt, A, B, C, D, dt_bias, s0], dtype)
    s0_before = gpu[7].clone()
    yg = ssd.sglang_block_scan(*gpu)
    return {"y": rel(yg, y), "state_written": float(not torch.equal(gpu[7], s0_before))}


def ssd_mamba_ssm_case(b, L, h, p, n, g, chunk, dtype):
    cpu = [t.requires_grad_(True) for t in _ssd_inputs(b, L, h, p, n, g)]
    gen = torch.Generator().manual_seed(7)
    gy, gs = torch.randn(b, L, h, p, generator=gen, dtype=torch.float64), torch.randn(b, h, p, n, generator=gen,
                                                                                      dtype=torch.float64)
    y, s = ssd.ssd_block(cpu[0], F.softplus(cpu[1] + cpu[6]), cpu[2], cpu[3], cpu[4], cpu[5], cpu[7])
    ((y * gy).sum() + (s * gs).sum()).backward()
    gpu = _on_gpu(cpu, dtype, grad=True)
    yg, sg = ssd._kernel("mamba_ssm")(gpu[0], gpu[1], gpu[2], gpu[3], gpu[4], chunk, D=gpu[5], dt_bias=gpu[6],
                                      dt_softplus=True, initial_states=gpu[7], return_final_states=True)
    ((yg.float() * gy.cuda().float()).sum() + (sg.float() * gs.cuda().float()).sum()).backward()
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")
    res = {"y": rel(yg, y), "final_state": rel(sg, s)}
    res.update({f"grad_{nm}": rel(gg.grad, gc.grad) for nm, gg, gc in zip(names, gpu, cpu)})
    return res


def _tiny_setup():
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
    hidden = torch.stack(out.hidden_states[1:], 2)[:, :, list(cfg.target_layer_ids)]
    return target, ids, hidden, kv, cfg, model


def _gpu_copy(target, cfg, model, act, device="cuda"):
    from sglang_hspec.model import build_drafter

    embed = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.to(device, act))
    lm = torch.nn.Linear(cfg.hidden_size, cfg.target.vocab_size, bias=False).to(device, act)
    lm.weight.data.copy_(target.lm_head.weight.to(act))
    gmodel = build_drafter("hspec", cfg, embed, lm).to(device, act)
    gmodel.load_state_dict(model.state_dict())
    return gmodel


class _Feats:
    def __init__(self, hidden, kv, device, dtype):
        self.hidden = hidden.to(device, dtype)
        self.kv = {i: (k.to(device, dtype), v.to(device, dtype)) for i, (k, v) in kv.items()}


def drafter_train_case(dtype, device="cuda"):
    target, ids, hidden, kv, cfg, model = _tiny_setup()
    anchors = torch.tensor([[5, 30, 60, 88]] * 4)
    ref = model.forward_train(_Feats(hidden, kv, "cpu", torch.float64), ids, anchors)
    (ref.logits.square().mean() + ref.confidence_logits.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    act = torch.float32 if dtype == "fp32" else torch.bfloat16
    gmodel = _gpu_copy(target, cfg, model, act, device)
    ssd.SCANS_RUN.clear()
    res = gmodel.forward_train(_Feats(hidden, kv, device, act), ids.to(device), anchors.to(device))
    (res.logits.float().square().mean() + res.confidence_logits.float().sum()).backward()
    worst = max(((n, rel(p.grad, ref_grads[n])) for n, p in gmodel.named_parameters()), key=lambda t: t[1])
    return {"logits": rel(res.logits, ref.logits), "confidence": rel(res.confidence_logits, ref.confidence_logits),
            "worst_grad": worst[1], "worst_grad_param": worst[0], "scans_run": sorted(ssd.SCANS_RUN),
            "expected_scan": "mamba_ssm"}


def _propose_inputs(hidden, kv, cfg, device, dtype, rows=(0, 1, 2, 3), last=(40, 57, 88, 95)):
    from sglang_hspec.core.types import DraftContext
    from sglang_hspec.target.kv_view import TargetKVView, window_indices

    n = torch.tensor(last, device=device)
    r = torch.tensor(rows, device=device)
    pos, valid = window_indices(n, cfg.sliding_window)  # fixed width: no host read of the lengths
    views = {lid: TargetKVView(key=kv[lid][0].to(device, dtype), value=kv[lid][1].to(device, dtype), token_index=pos,
                               positions=pos, valid=valid, row_index=r) for lid in cfg.kv_reuse_layer_ids}
    return DraftContext(anchor_tokens=torch.tensor([7, 9, 11, 13], device=device), last_position=n,
                        target_hidden=hidden[list(rows), list(last)].to(device, dtype), kv_views=views)


def expected_inference_scan(available: dict[str, bool]) -> str:
    return "sglang" if available.get("sglang") else "mamba_ssm"


def drafter_propose_case(dtype, available, device="cuda"):
    from sglang_hspec.core.types import SamplingParams

    target, ids, hidden, kv, cfg, model = _tiny_setup()
    with torch.no_grad():
        ctx = _propose_inputs(hidden, kv, cfg, "cpu", torch.float64)
        ref_h = model.backbone(ctx.anchor_tokens, ctx.last_position, ctx.target_hidden, model.propose_contexts(ctx))
        ref = model.propose(ctx, SamplingParams())
        act = torch.float32 if dtype == "fp32" else torch.bfloat16
        gmodel = _gpu_copy(target, cfg, model, act, device)
        gctx = _propose_inputs(hidden, kv, cfg, device, act)
        ssd.SCANS_RUN.clear()
        h = gmodel.backbone(gctx.anchor_tokens, gctx.last_position, gctx.target_hidden, gmodel.propose_contexts(gctx))
        prop = gmodel.propose(gctx, SamplingParams())
    return {"hidden": rel(h, ref_h), "greedy_token_mismatch": float((prop.tokens.cpu() != ref.tokens).float().mean()),
            "confidence": rel(prop.confidence_logits, ref.confidence_logits),
            "scans_run": sorted(ssd.SCANS_RUN), "expected_scan": expected_inference_scan(available)}


def graph_case(available, device="cuda"):
    """propose captured in a CUDA graph and replayed on new inputs == eager propose on those inputs."""
    from sglang_hspec.core.types import SamplingParams

    target, ids, hidden, kv, cfg, model = _tiny_setup()
    gmodel = _gpu_copy(target, cfg, model, torch.float32, device)
    ctx = _propose_inputs(hidden, kv, cfg, device, torch.float32)
    greedy = SamplingParams()
    ssd.SCANS_RUN.clear()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture (Triton compiles, caches fill)
            for _ in range(2):
                gmodel.propose(ctx, greedy)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = gmodel.propose(ctx, greedy)
        new = _propose_inputs(hidden, kv, cfg, device, torch.float32, rows=(3, 2, 1, 0), last=(95, 12, 70, 33))
        ctx.anchor_tokens.copy_(torch.tensor([21, 5, 300, 44], device=device))
        ctx.last_position.copy_(new.last_position)
        ctx.target_hidden.copy_(new.target_hidden)
        for lid, view in ctx.kv_views.items():
            for name in ("token_index", "positions", "valid", "row_index"):
                getattr(view, name).copy_(getattr(new.kv_views[lid], name))
        graph.replay()
        torch.cuda.synchronize()
        eager = gmodel.propose(ctx, greedy)
    return {"replay_token_mismatch": float((static.tokens != eager.tokens).float().mean()),
            "replay_confidence": rel(static.confidence_logits, eager.confidence_logits),
            "scans_run": sorted(ssd.SCANS_RUN), "expected_scan": expected_inference_scan(available)}


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
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")  # any host read-back raises
                try:
                    got = planner.topk_lengths(survival=dev, budget=budget, min_survival=1e-6)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                mismatches += int(not torch.equal(got.cpu(), want))
                cases += 1
    return {"topk_mismatched_cases": float(mismatches), "cases": cases}


def readback_case(device="cuda"):
    """The auto switch's read-back of the tokens a drafting step committed (sglang_plugin/readback.py) on CUDA:
    pushing device sums never syncs the host (sync debug mode 'error' raises on any read-back), and every sum
    comes back right and in push order once its copy has landed."""
    from sglang_hspec.sglang_plugin.readback import AsyncSums

    gen = torch.Generator().manual_seed(6)
    values = [torch.randint(1, 9, (n,), generator=gen, dtype=torch.int32) for n in (1, 4, 16, 32, 3, 7)]
    on_device = [v.to(device) for v in values]
    sums = AsyncSums(capacity=8)
    got = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, v in enumerate(on_device):
            torch.cuda._sleep(2_000_000)  # keep the stream busy: the copy cannot have landed at push time
            sums.push(i, v)
            got += sums.ready()
        early = len(got)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    got += sums.ready()
    want = [(i, int(v.sum())) for i, v in enumerate(values)]
    return {"readback_mismatch": float(got != want), "ready_before_sync": early, "sums": len(got)}


# ---- bf16 greedy identity (docs/results.md, "bf16 greedy identity"); owner of this item: the target adapter
def batch_invariance_case(device="cuda"):
    """Reference engine's batch-invariant target on CUDA, bf16: an 8-token verify forward against 8 one-token
    decodes must give bitwise-equal logits (row mismatch 0). On CPU this holds; on CUDA the linear layers
    (cuBLAS picks kernels by M) and cumsum (a parallel scan) may break it: the check says which. SDPA's rows
    that differ are recorded for comparison only."""
    from sglang_hspec.assets.tiny import tiny_target
    from sglang_hspec.target.adapter import TargetAdapter, linear_rows_are_batch_invariant

    gen = torch.Generator().manual_seed(2)
    prompt, block = torch.randint(3, 128, (1, 30), generator=gen), torch.randint(3, 128, (1, 8), generator=gen)
    differing = {}
    for mode in (False, True):
        adapter = TargetAdapter(tiny_target("llama", seed=3, dtype=torch.bfloat16, num_layers=3).to(device),
                                batch_invariant=mode)
        adapter.reset(1, capacity=64)
        adapter.extend(prompt)
        verify = adapter.extend(block).logits[0]
        adapter.truncate(torch.tensor([30]))
        singles = torch.stack([adapter.extend(block[:, j:j + 1]).logits[0, 0] for j in range(8)])
        differing[mode] = int((verify != singles).any(-1).sum())
    return {"batch_invariant_row_mismatch": differing[True] / 8.0, "sdpa_rows_differing": differing[False],
            "linear_rows_batch_invariant": linear_rows_are_batch_invariant(dtype=torch.bfloat16, device=device)}


def continuous_decoder_case(device="cuda"):
    """`hspec data regenerate --device cuda`'s decode path: the continuous decoder (rows refilled as requests end)
    on CUDA in float64 gives the CPU's greedy replies token for token, and a seeded sampled call reproduces
    itself there."""
    from sglang_hspec.assets.tiny import tiny_target
    from sglang_hspec.core.types import SamplingParams
    from sglang_hspec.engine.continuous import ContinuousDecoder
    from sglang_hspec.target.adapter import TargetAdapter

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (12,), generator=gen)]
    greedy = SamplingParams(max_new_tokens=24)
    replies = {}
    for dev in ("cpu", device):
        adapter = TargetAdapter(tiny_target("llama", vocab_size=96, dtype=torch.float64, seed=5).to(dev))
        replies[dev] = [r.output_ids for r in ContinuousDecoder(adapter, slots=5, eos_token_ids=[2, 7]).generate(
            prompts, greedy)]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=11)
    a, b = (ContinuousDecoder(adapter, slots=5).generate(prompts, sampled) for _ in range(2))
    return {"greedy_reply_mismatch": sum(x != y for x, y in zip(replies["cpu"], replies[device])) / len(prompts),
            "sampled_rerun_mismatch": sum(x.output_ids != y.output_ids for x, y in zip(a, b)) / len(prompts),
            "tokens": sum(map(len, replies[device]))}


def failures_of(checks: dict) -> list[str]:
    """Every way a recorded check fails: an error, a value over its tolerance, a non-zero mismatch or
    written state, or a Mamba scan other than the one the check exists to run."""
    out = []
    for name, r in checks.items():
        if "error" in r:
            out.append(f"{name}: {r['error']}")
            continue
        out_tol, grad_tol = TOL["bf16" if "bf16" in name else "fp32"]
        for key, v in r.items():
            if not isinstance(v, float):
                continue
            if key == "state_written":
                limit = 0.0
            elif "mismatch" in key:
                limit = 0.25 if "bf16" in name else 0.0  # bf16 logits may flip the drafter's near-ties
            else:
                limit = grad_tol if "grad" in key else out_tol
            if v > limit:
                out.append(f"{name}.{key} = {v:.2e} (limit {limit:.0e})")
        if "expected_scan" in r and r["expected_scan"] not in r.get("scans_run", []):
            out.append(f"{name}: expected the {r['expected_scan']} Mamba scan, ran {r.get('scans_run')}")
    return out


def kernel_availability() -> tuple[dict[str, bool], dict[str, dict]]:
    available, checks = {}, {}
    for backend, extra in (("sglang", "sglang-hspec[sglang] (sglang==0.5.23)"), ("mamba_ssm", "sglang-hspec[gpu]")):
        k = ssd._kernel(backend)
        available[backend] = not isinstance(k, ImportError)
        checks[f"kernel_{backend}_installed"] = ({} if available[backend] else
                                                 {"error": f"not importable ({k}); install {extra} on this machine"})
    return available, checks


def smallest_configs(configs, keep: int = 3):
    """The `keep` Triton configs with the smallest shared-memory footprint estimate (pipeline stages x tile
    elements). More than one: the autotuner then still skips a config that does not fit (on the H200, the
    single smallest config of one of mamba_ssm's fp32 kernels asked 257 KiB of shared memory, over 227)."""
    def footprint(c):
        return c.num_stages * math.prod(v for k, v in c.kwargs.items() if k.startswith("BLOCK") and isinstance(v, int))
    return sorted(configs, key=lambda c: (footprint(c), c.num_warps))[:keep]


def checks_plan(available: dict[str, bool]) -> list[tuple[str, object]]:
    """Every check, in the order that keeps the most coverage if the time budget runs out: the first SSD
    shape of each installed kernel and dtype (a smoke test, and it compiles the kernels), the drafter, the
    CUDA graph, the planner and the target, then the rest of the SSD shape sweep."""
    def ssd_cases(shapes):
        out = []
        for dtype in ("fp32", "bf16"):
            for shp in shapes:
                tag = "x".join(map(str, shp))
                for backend, case in (("sglang", ssd_sglang_case), ("mamba_ssm", ssd_mamba_ssm_case)):
                    if available[backend]:
                        out.append((f"ssd_{backend}_{dtype}_{tag}", lambda s=shp, d=dtype, c=case: c(*s, d)))
        return out

    plan = ssd_cases(SSD_SHAPES[:1])
    for dtype in ("fp32", "bf16"):
        plan.append((f"drafter_propose_{dtype}", lambda d=dtype: drafter_propose_case(d, available)))
        plan.append((f"drafter_train_{dtype}", lambda d=dtype: drafter_train_case(d)))
    plan.append(("cuda_graph_propose_fp32", lambda: graph_case(available)))
    plan.append(("planner_topk_fp32", planner_case))
    plan.append(("readback_no_sync", readback_case))
    plan.append(("target_batch_invariance", batch_invariance_case))
    plan.append(("continuous_decoder_fp64", continuous_decoder_case))
    return plan + ssd_cases(SSD_SHAPES[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check_out"))
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new checks after this many seconds")
    ap.add_argument("--autotune", choices=("all", "smallest"), default=os.environ.get("GPU_CHECK_AUTOTUNE", "smallest"),
                    help="'smallest': each Triton autotuner keeps its 3 configs of least shared memory (numerics "
                         "must hold for every config; on an H200 with a cold cache, 'all' spent "
                         "230 s compiling mamba_ssm's fp32 scan for one shape, so the sweep cannot fit 8 minutes)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"cuda": torch.cuda.is_available(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
              "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"), "autotune": args.autotune,
              "checks": {}, "check_seconds": {}, "not_run": [], "failures": []}
    if not torch.cuda.is_available():
        msg = (f"no CUDA device visible to torch {torch.__version__} (CUDA build {torch.version.cuda}); "
               "scripts/gpu_check.sh runs only on a GPU machine: nothing was checked")
        report["failures"].append(msg)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"gpu_check: FAIL: {msg}", file=sys.stderr)
        return NO_CUDA_EXIT
    report["device"] = torch.cuda.get_device_name()
    if args.autotune == "smallest":
        import triton

        full_autotune = triton.autotune
        triton.autotune = lambda configs, *a, **k: full_autotune(smallest_configs(configs), *a, **k)
    available, report["checks"] = kernel_availability()
    report["kernels"] = available
    plan = checks_plan(available)
    t0 = time.time()
    for name, fn in plan:
        if time.time() - t0 > args.budget_s:
            report["not_run"].append(name)
            continue
        started = time.time()
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - record and continue: one check must not hide the rest
            r = {"error": f"{type(e).__name__}: {e}"}
        report["check_seconds"][name] = round(time.time() - started, 2)
        report["checks"][name] = r
        print(name, r, flush=True)
    report["failures"] = failures_of(report["checks"]) + [f"{n}: not run (time budget)" for n in report["not_run"]]
    report["seconds"] = round(time.time() - t0, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print("FAILURES:" if report["failures"] else "all GPU checks passed", *report["failures"], sep="\n  ")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
