"""Draft-block attention over a paged KV pool: the Triton kernel vs the torch gather + SDPA path, side by side.

    python scripts/bench_block_attention.py [--batches 1,8,48] [--contexts 512,2048,8192] [--dtype bfloat16]
        [--kv-dtype auto|fp8_e4m3] [--q-heads 32 --kv-heads 8 --head-dim 128] [--block-size 7]

Needs CUDA (on CPU the kernel only runs interpreted, which says nothing about speed). Qwen3-8B geometry
by default (32 query / 8 KV heads, head_dim 128), sliding window 2048, page size 1 with slots scattered
over the pool as SGLang's allocator leaves them. Prints the GPU, dtypes, microseconds per call (median
of CUDA-event timings) of both paths, their ratio and the max abs difference between them."""

from __future__ import annotations

import argparse
import statistics

import torch

from sglang_hspec.kernels import PagedKVWindow, paged_block_attention

WINDOW = 2048


def _time_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,48")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_block_attention.py times the CUDA kernel and needs a CUDA device; the CPU path "
                         "is the torch reference (see tests/kernels for its interpreter parity checks)")
    dtype = getattr(torch, args.dtype)
    kv_dtype = {"auto": dtype, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[args.kv_dtype]
    print(f"GPU {torch.cuda.get_device_name()}  dtype {args.dtype}  KV {kv_dtype}  heads {args.q_heads}/"
          f"{args.kv_heads}  head_dim {args.head_dim}  block_size {args.block_size}  sliding_window {WINDOW}")
    print(f"{'batch':>5} {'context':>7} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'max|diff|':>10}")
    g = torch.Generator(device="cuda").manual_seed(0)
    H, Hkv, D, L = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    for B in (int(x) for x in args.batches.split(",")):
        for N in (int(x) for x in args.contexts.split(",")):
            slots = B * N + 1
            key = torch.randn(slots, Hkv, D, device="cuda", dtype=dtype, generator=g).to(kv_dtype)
            value = torch.randn(slots, Hkv, D, device="cuda", dtype=dtype, generator=g).to(kv_dtype)
            perm = torch.randperm(slots - 1, device="cuda", generator=g) + 1
            req_to_token = perm.view(B, N).to(torch.int32)
            kv = PagedKVWindow(key_buffer=key, value_buffer=value, req_to_token=req_to_token,
                               req_pool_indices=torch.arange(B, device="cuda"),
                               seq_lens=torch.full((B,), N, device="cuda"), sliding_window=WINDOW,
                               k_scale=0.5 if kv_dtype != dtype else 1.0, v_scale=0.5 if kv_dtype != dtype else 1.0)
            q = torch.randn(B, L, H, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
            k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
            v = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
            args_ = (q, k, v, kv)
            tri = lambda a=args_: paged_block_attention(*a, backend="triton")
            ref = lambda a=args_: paged_block_attention(*a, backend="torch")
            t_tri, t_ref = _time_us(tri, args.reps), _time_us(ref, args.reps)
            diff = (tri().float() - ref().float()).abs().max().item()
            print(f"{B:>5} {N:>7} {t_tri:>10.1f} {t_ref:>10.1f} {t_ref / t_tri:>7.2f}x {diff:>10.2e}")


if __name__ == "__main__":
    main()
