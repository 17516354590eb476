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
6. Serving path (SGLang's conditions without an SGLang server):
   - `paged_attention_*`: the Triton kernel of sglang_hspec/kernels over a pool laid out as SGLang's
     MHATokenToKVPool lays it out ([size + page_size, kv_heads, head_dim] per layer, FP8 stored as uint8 and
     read through a float8 view, written as SGLang's set_kv_buffer writes: k / k_scale cast), pages handed
     out in random order, a token-granular req_to_token; page sizes 1 and 16, bf16 and fp8_e4m3 KV, against
     the float64 torch twin; `paged_block_attention(backend="auto")` must pick the kernel on CUDA;
   - `draft_model_graph_bf16`: `HSpecDraftModel` (sglang_plugin/draft_model.py) built as SGLang's loader
     builds it (config.json through AutoConfig, default dtype bf16 and the device while constructing,
     `load_weights`, `.eval()`), bound to such a pool, its `forward(input_ids, positions, forward_batch)`
     captured in a CUDA graph and replayed the way SGLang's graph runner does it: grad mode on, parameters
     as loaded, no host sync (sync debug mode "error"). Must run SGLang's Mamba inference kernel, build no
     autograd graph, equal the float64 reference backbone, and replay equal to eager on new requests.
   - `readback_no_sync` (item 5's neighbour): the `auto` switch's device sums read back without a sync.
   Where SGLang itself is not installed (the lent GPU machine: scripts/gpu_stage.sh stages its Mamba
   kernel only), draft_model.py's seven SGLang imports get minimal stand-ins (`sglang_stand_ins`): the
   forward under test is ours; the stand-ins cover a result dataclass and heads the forward never calls.
The device's torch / CUDA / Triton / transformers / SGLang versions are printed first and recorded.
`--dry-run` (no GPU needed; .venv-sglang): the imports, then the checks that run on CPU (the kernel cases
under TRITON_INTERPRET=1, the draft model's forward in grad mode without the graph) - the CUDA-only ones
are listed as not run.
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

if "--dry-run" in sys.argv and not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated (on import): before anything imports one
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.append(str(Path(__file__).resolve().parents[1]))  # an installed sglang_hspec (gpu_check.sh) goes first
from sglang_hspec.model import ssd  # noqa: E402

TOL = {"fp32": (1e-4, 1e-3), "bf16": (5e-2, 1.5e-1)}  # (outputs/state, gradients), relative to max |ref|
SSD_SHAPES = [(4, 7, 48, 64, 4, 4, 256), (4, 8, 48, 64, 4, 4, 256), (128, 16, 48, 64, 4, 4, 256),
              (4, 8, 48, 64, 4, 4, 16), (3, 12, 8, 64, 16, 1, 256), (2, 1, 48, 64, 4, 4, 256),
              (2, 40, 8, 64, 16, 2, 16)]  # (b, L, h, p, n, g, chunk)
NO_CUDA_EXIT = 2
# flags a check records as 0.0 / 1.0 that must be 0 whatever the dtype
MUST_BE_ZERO = {"non_finite", "auto_vs_kernel_mismatch", "grad_mode_off", "params_requiring_grad",
                "autograd_graph_built", "context_rows_require_grad", "replay_autograd_graph_built", "readback_mismatch"}


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


# ---- the serving path: SGLang's paged pool, HSpecDraftModel.forward as SGLang's graph runner calls it
def versions() -> dict:
    """What this machine runs the checks with (printed first: results are only comparable on equal stacks)."""
    import platform
    from importlib import metadata

    def dist(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    try:
        import triton
        triton_version = triton.__version__
    except ImportError as e:
        triton_version = f"not importable ({e})"
    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "triton": triton_version, "transformers": dist("transformers"), "sglang": dist("sglang"),
           "sglang_kernel": dist("sglang-kernel"), "mamba_ssm": dist("mamba-ssm")}
    if torch.cuda.is_available():
        out.update(device=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())))
    return out


class SGLangPool:
    """A KV pool laid out as SGLang 0.5.23's MHATokenToKVPool: per layer [size + page_size, kv_heads, head_dim]
    (slots 0 .. page_size - 1 are padding), FP8 pools stored as uint8 and read through a float8 view
    (`get_key_buffer`), written as `set_kv_buffer` writes them (k / k_scale cast to the store dtype), pages
    handed out in random order and a token-granular req_to_token [rows, max_context] int32."""

    def __init__(self, *, layers: int, size: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device, rows: int = 8, max_context: int = 160, seed: int = 0):
        self.page_size, self.dtype = page_size, dtype
        self.store_dtype = torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
        shape = (size + page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=self.store_dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=self.store_dtype, device=device) for _ in range(layers)]
        self.req_to_token = torch.zeros(rows, max_context, dtype=torch.int32, device=device)
        gen = torch.Generator().manual_seed(seed)
        self._free = (torch.randperm(size // page_size, generator=gen) + 1).tolist()  # page 0 = padding

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer].view(self.dtype) if self.store_dtype != self.dtype else self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer].view(self.dtype) if self.store_dtype != self.dtype else self.v[layer]

    def allocate(self, row: int, n: int) -> torch.Tensor:
        """Slots of positions 0 .. n-1 of request slot `row`: whole pages from the free list, in its order."""
        pages = [self._free.pop() for _ in range(-(-n // self.page_size))]
        slots = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])[:n]
        self.req_to_token[row, :n] = slots.to(self.req_to_token.device, torch.int32)
        return slots

    def set_kv_buffer(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        loc = loc.to(self.k[layer].device)
        if self.store_dtype != self.dtype:
            k, v = (k / k_scale).to(self.dtype).view(self.store_dtype), (v / v_scale).to(self.dtype).view(self.store_dtype)
        self.k[layer][loc] = k.to(self.k[layer].device, self.k[layer].dtype)
        self.v[layer][loc] = v.to(self.v[layer].device, self.v[layer].dtype)


def paged_attention_case(page_size: int, kv: str, device="cuda"):
    """The serving kernel on an SGLang-layout pool: GQA 4 (8 query / 2 KV heads), head_dim 64, window 48,
    ragged lengths (one shorter than the window, one a page boundary), random page order, stale slots in
    the spare pages, against the float64 twin on the same storage; `auto` must pick the kernel on CUDA."""
    from sglang_hspec.kernels import PagedKVWindow, paged_block_attention, paged_block_attention_reference
    from sglang_hspec.kernels.triton_block_attention import triton_paged_block_attention

    kv_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv]
    k_scale, v_scale = (0.37, 1.9) if kv == "fp8" else (1.0, 1.0)
    gen = torch.Generator().manual_seed(page_size * 10 + len(kv))
    lens, hq, hkv, d, L, window = [33, 64, 100, 7], 8, 2, 64, 7, 48
    pool = SGLangPool(layers=1, size=512, page_size=page_size, kv_heads=hkv, head_dim=d, dtype=kv_dtype, device=device)
    for layer_buf in (pool.k[0], pool.v[0]):  # stale data everywhere: only the window's slots may be read
        layer_buf.copy_(torch.randn(layer_buf.shape, generator=gen).to(kv_dtype).view(pool.store_dtype))
    rows = torch.tensor([5, 0, 3, 6])
    for row, n in zip(rows.tolist(), lens):
        loc = pool.allocate(row, n)
        pool.set_kv_buffer(0, loc, torch.randn(n, hkv, d, generator=gen) * 2, torch.randn(n, hkv, d, generator=gen),
                           k_scale=k_scale, v_scale=v_scale)
    win = PagedKVWindow(key_buffer=pool.get_key_buffer(0), value_buffer=pool.get_value_buffer(0),
                        req_to_token=pool.req_to_token, req_pool_indices=rows.to(device),
                        seq_lens=torch.tensor(lens, device=device), sliding_window=window, k_scale=k_scale,
                        v_scale=v_scale)
    q, kb, vb = (torch.randn(len(lens), L, h, d, generator=gen).transpose(1, 2) for h in (hq, hkv, hkv))
    act = torch.bfloat16
    qg, kg, vg = (t.to(device, act) for t in (q, kb, vb))
    cpu = PagedKVWindow(key_buffer=win.key_buffer.cpu(), value_buffer=win.value_buffer.cpu(),
                        req_to_token=pool.req_to_token.cpu(), req_pool_indices=rows, seq_lens=torch.tensor(lens),
                        sliding_window=window, k_scale=k_scale, v_scale=v_scale)
    ref = paged_block_attention_reference(qg.cpu().double(), kg.cpu().double(), vg.cpu().double(), cpu)
    out = triton_paged_block_attention(qg, kg, vg, win, causal=True, sm_scale=d ** -0.5)
    res = {"out": rel(out, ref), "non_finite": float(not torch.isfinite(out.float()).all())}
    if torch.device(device).type == "cuda":
        auto = paged_block_attention(qg, kg, vg, win)
        res["auto_vs_kernel_mismatch"] = float(not torch.equal(auto, out))
    return res


def _import_draft_model() -> bool:
    """Import sglang_plugin.draft_model. Where SGLang is not installed (the lent GPU machine has only the Mamba
    kernel that scripts/gpu_stage.sh stages), register stand-ins for the names it imports first: a result
    dataclass with SGLang's two fields, two marker classes, and heads / helpers the forward never calls (they
    raise if called). Returns whether stand-ins were used."""
    try:
        import sglang.srt.models.dspark  # noqa: F401
        return False
    except ImportError:
        pass
    import dataclasses
    import types

    def module(name, **attrs):
        mod = sys.modules.get(name) or types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(module(parent), leaf, mod)
        return mod

    @dataclasses.dataclass
    class LogitsProcessorOutput:
        next_token_logits: object
        hidden_states: object = None

    class UnquantizedEmbeddingMethod:
        pass

    class BaseDSparkMarkovHead(torch.nn.Module):
        pass

    def not_here(*_, **__):
        raise RuntimeError("an SGLang stand-in of scripts/gpu_check.py was called: this check needs SGLang itself")

    try:
        import sglang  # noqa: F401 - the package stubs gpu_stage.sh staged: the stand-ins go beside its kernel
    except ImportError:
        pass  # module() creates the parents
    module("sglang.srt.layers.logits_processor", LogitsProcessorOutput=LogitsProcessorOutput)
    module("sglang.srt.layers.quantization.unquant", UnquantizedEmbeddingMethod=UnquantizedEmbeddingMethod)
    module("sglang.srt.models.dspark", BaseDSparkMarkovHead=BaseDSparkMarkovHead,
           build_confidence_head=lambda config: None,  # SGLang's static verify mode builds none
           gather_and_crop_vocab=not_here, project_through_lm_head=not_here)
    module("sglang.srt.speculative.dspark_components.dspark_config",
           get_dspark_sample_from_anchor=lambda config: bool(getattr(config, "sample_from_anchor", True)))
    return True


def _hspec_draft_model(cfg, model, target, pool, *, device, act):
    """HSpecDraftModel from `model`'s save_drafter checkpoint, as SGLang's DefaultModelLoader builds it
    (set_default_torch_dtype(model dtype), the device as default while constructing, load_weights, eval)."""
    import tempfile

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sglang_hspec.model.checkpoint import save_drafter
    from sglang_hspec.sglang_plugin.draft_model import HSpecDraftModel

    with tempfile.TemporaryDirectory() as tmp:
        save_drafter(model, tmp, dtype=torch.float32)
        config = AutoConfig.from_pretrained(tmp)
        weights = load_file(f"{tmp}/model.safetensors")
    before = torch.get_default_dtype()
    torch.set_default_dtype(act)
    try:
        with torch.device(device):
            dm = HSpecDraftModel(config)
            dm.load_weights(weights.items())
    finally:
        torch.set_default_dtype(before)
    dm = dm.eval()
    embed = torch.nn.Embedding.from_pretrained(target.model.embed_tokens.weight.to(device, act))
    lm = torch.nn.Linear(cfg.hidden_size, cfg.target.vocab_size, bias=False, device=device, dtype=act)
    lm.weight.data.copy_(target.lm_head.weight.to(act))
    lm.requires_grad_(False)  # SGLang's ParallelLMHead / VocabParallelEmbedding hold no-grad parameters
    dm.attach_shared_modules(embed_tokens=embed, lm_head=lm)
    dm.bind_target_kv(pool, pool.req_to_token)
    return dm


def draft_model_graph_case(available, device="cuda", *, capture=True):
    """HSpecDraftModel.forward as SGLang's decode graph runner calls it (runner/decode_cuda_graph_runner.py
    `capture_one_shape`: `forward(input_ids, positions, forward_batch)`, no no_grad of its own): grad mode on,
    parameters as loaded, over an SGLang-layout bf16 pool with page size 16. Eager against the float64
    reference backbone; then captured (warm-up on a side stream first, as SGLang does) and replayed on other
    requests, lengths and anchors, under sync debug mode "error", against eager on those."""
    from types import SimpleNamespace

    from sglang_hspec.sglang_plugin.context import ContextState

    stand_ins = _import_draft_model()
    act = torch.bfloat16
    target, ids, hidden, kv, cfg, model = _tiny_setup()
    t = cfg.target
    pool = SGLangPool(layers=t.num_hidden_layers, size=1024, page_size=16, kv_heads=t.num_key_value_heads,
                      head_dim=t.head_dim, dtype=act, device=device)
    rows, last = [5, 0, 3, 6], [40, 57, 88, 95]  # request b of the target batch lives in request slot rows[b]
    for b, row in enumerate(rows):
        loc = pool.allocate(row, ids.shape[1])
        for layer, (k, v) in kv.items():  # [B, kv_heads, T, D] -> SGLang's [tokens, kv_heads, D]
            pool.set_kv_buffer(layer, loc, k[b].transpose(0, 1), v[b].transpose(0, 1))
    dm = _hspec_draft_model(cfg, model, target, pool, device=device, act=act)
    state = ContextState(req_pool_size=8, rank=cfg.fusion_rank, project=dm.project_context, device=device, dtype=act)
    dm.context_state = state
    requires_grad = sorted(n for n, p in dm.named_parameters() if p.requires_grad)
    k = cfg.block_size
    packed = hidden.flatten(2)  # [B, T, 5 * H]: SGLang packs the captured layers in layer order, each once

    def inputs(order, lens, anchors):
        """The batch SGLang's draft step hands the model: block ids [anchor, mask x (k-1)] per request, the
        committed lengths n + 1, request slots; the context rows as the verify commit leaves them."""
        state.write(torch.tensor([rows[b] for b in order], device=device),
                    packed[list(order), [lens[i] - 1 for i in range(len(order))]].to(device, act))
        block = torch.full((len(order), k), cfg.mask_token_id, device=device)
        block[:, 0] = torch.tensor(anchors, device=device)
        seq = torch.tensor(lens, device=device)
        fb = SimpleNamespace(batch_size=len(order), req_pool_indices=torch.tensor([rows[b] for b in order], device=device),
                             seq_lens=seq)
        return block.reshape(-1), (seq[:, None] + torch.arange(k, device=device)).reshape(-1), fb

    def reference(order, lens, anchors):
        from sglang_hspec.core.types import DraftContext

        ctx = _propose_inputs(hidden, kv, cfg, "cpu", torch.float64, rows=tuple(order), last=tuple(n - 1 for n in lens))
        ctx = DraftContext(anchor_tokens=torch.tensor(anchors), last_position=ctx.last_position,
                           target_hidden=ctx.target_hidden, kv_views=ctx.kv_views)
        with torch.no_grad():
            return model.backbone(ctx.anchor_tokens, ctx.last_position, ctx.target_hidden,
                                  model.propose_contexts(ctx)).reshape(len(order) * k, -1)

    first = ((0, 1, 2, 3), [n + 1 for n in last], [7, 9, 11, 13])
    ssd.SCANS_RUN.clear()
    grad_mode = torch.is_grad_enabled()
    ids_s, pos_s, fb_s = inputs(*first)
    eager = dm.forward(ids_s, pos_s, fb_s).hidden_states
    res = {"grad_mode_off": float(not grad_mode), "params_requiring_grad": float(len(requires_grad)),
           "autograd_graph_built": float(eager.requires_grad or eager.grad_fn is not None),
           "context_rows_require_grad": float(state.buffer.requires_grad),
           "hidden_vs_float64": rel(eager, reference(*first)), "sglang_stand_ins": stand_ins,
           "expected_scan": expected_inference_scan(available) if torch.device(device).type == "cuda" else "torch"}
    if requires_grad:
        res["first_params_requiring_grad"] = requires_grad[:3]
    if capture:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # SGLang's warm-up runs before capture (Triton compiles, caches fill)
            for _ in range(2):
                dm.forward(ids_s, pos_s, fb_s)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the forward raises
        try:
            with torch.cuda.graph(graph):
                static = dm.forward(ids_s, pos_s, fb_s).hidden_states
        finally:
            torch.cuda.set_sync_debug_mode(0)
        second = ((3, 1, 0, 2), [96, 13, 71, 34], [21, 5, 300, 44])  # other slots, lengths (a page boundary), anchors
        new_ids, new_pos, new_fb = inputs(*second)
        ids_s.copy_(new_ids)
        pos_s.copy_(new_pos)
        fb_s.req_pool_indices.copy_(new_fb.req_pool_indices)
        fb_s.seq_lens.copy_(new_fb.seq_lens)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        replayed = static.clone()
        again = dm.forward(ids_s, pos_s, fb_s).hidden_states
        res.update(replay_vs_eager=rel(replayed, again), replay_vs_float64=rel(replayed, reference(*second)),
                   replay_autograd_graph_built=float(static.requires_grad or static.grad_fn is not None))
    res["scans_run"] = sorted(ssd.SCANS_RUN)
    return res


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
            if key == "state_written" or key in MUST_BE_ZERO:
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
    # the serving path first after the smoke test: never run on a GPU before (docs/serving.md, "Launch checks")
    for page in (1, 16):
        for kv in ("bf16", "fp8"):
            plan.append((f"paged_attention_bf16_kv{kv}_page{page}", lambda p=page, k=kv: paged_attention_case(p, k)))
    plan.append(("draft_model_graph_bf16", lambda: draft_model_graph_case(available)))
    plan.append(("readback_no_sync", readback_case))
    for dtype in ("fp32", "bf16"):
        plan.append((f"drafter_propose_{dtype}", lambda d=dtype: drafter_propose_case(d, available)))
        plan.append((f"drafter_train_{dtype}", lambda d=dtype: drafter_train_case(d)))
    plan.append(("cuda_graph_propose_fp32", lambda: graph_case(available)))
    plan.append(("planner_topk_fp32", planner_case))
    plan.append(("target_batch_invariance", batch_invariance_case))
    plan.append(("continuous_decoder_fp64", continuous_decoder_case))
    return plan + ssd_cases(SSD_SHAPES[1:])


def dry_run(report: dict, out: Path) -> int:
    """What runs without a GPU: the imports every check needs, the paged kernel on SGLang-layout pools under
    Triton's interpreter (page sizes 1 and 16, bf16 and fp8; small enough for numpy), and the draft model's
    forward in grad mode, eager on CPU (torch Mamba scan). Everything CUDA-only is listed under not_run."""
    report["dry_run"] = True
    checks = report["checks"]
    for name in ("triton", "sglang_hspec.kernels.triton_block_attention", "sglang_hspec.sglang_plugin.readback",
                 "sglang_hspec.scheduler.planner", "safetensors.torch", "transformers"):
        try:
            __import__(name)
            checks[f"import_{name}"] = {}
        except Exception as e:  # noqa: BLE001
            checks[f"import_{name}"] = {"error": f"{type(e).__name__}: {e}"}
    plan = [(f"paged_attention_bf16_kv{kv}_page{page}", lambda p=page, k=kv: paged_attention_case(p, k, device="cpu"))
            for page in (1, 16) for kv in ("bf16", "fp8")]
    plan.append(("draft_model_forward_bf16", lambda: draft_model_graph_case({}, device="cpu", capture=False)))
    for name, fn in plan:
        started = time.time()
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001
            r = {"error": f"{type(e).__name__}: {e}"}
        report["check_seconds"][name] = round(time.time() - started, 2)
        checks[name] = r
        print(name, r, flush=True)
    report["not_run"] = [name for name, _ in checks_plan({"sglang": True, "mamba_ssm": True})
                         if not name.startswith("paged_attention")]
    report["failures"] = failures_of(checks)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print("DRY RUN FAILURES:" if report["failures"] else "dry run passed (CUDA-only checks not run: "
          f"{len(report['not_run'])})", *report["failures"], sep="\n  ")
    return 1 if report["failures"] else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check_out"))
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new checks after this many seconds")
    ap.add_argument("--autotune", choices=("all", "smallest"), default=os.environ.get("GPU_CHECK_AUTOTUNE", "smallest"),
                    help="'smallest': each Triton autotuner keeps its 3 configs of least shared memory (numerics "
                         "must hold for every config; on an H200 with a cold cache, 'all' spent "
                         "230 s compiling mamba_ssm's fp32 scan for one shape, so the sweep cannot fit 8 minutes)")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU needed: the imports and the checks that run on CPU (the paged kernel under "
                         "TRITON_INTERPRET=1, the draft model's forward in grad mode without the graph)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"cuda": torch.cuda.is_available(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
              "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"), "autotune": args.autotune,
              "versions": versions(), "checks": {}, "check_seconds": {}, "not_run": [], "failures": []}
    print("gpu_check: versions", json.dumps(report["versions"]), flush=True)
    if args.dry_run and not torch.cuda.is_available():
        return dry_run(report, out)
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
