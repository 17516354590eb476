"""The reference engine's `step_fn` for `hspec profile-sps`: one target verify forward on the TargetAdapter.

A probe of B batch tokens runs n = ceil(B / tokens_per_request) requests of ceil(B / n) tokens each
(exactly B when B is a multiple of tokens_per_request = 1 + k, the usual probe sizes), on top of
`context` cached tokens per request, the way the engine's verify step calls `TargetAdapter.extend`.
The KV is written but never committed, so every probe sees the same context.
"""

from __future__ import annotations

import math

import torch

from sglang_hspec.target.adapter import TargetAdapter


def _load_adapter(target: str, dtype: str, device: str | None) -> TargetAdapter:
    if target == "tiny":  # the in-code tiny Llama: tests and smoke runs
        from sglang_hspec.assets.tiny import tiny_target
        from sglang_hspec.target.dtypes import resolve_dtype

        adapter = TargetAdapter(tiny_target("llama", dtype=resolve_dtype(dtype)))
    else:
        from sglang_hspec.engine.loading import load_target

        adapter = load_target(target, dtype=dtype)
    if device is not None:
        adapter.model.to(device)
    return adapter


def make_step_fn(*, max_batch_tokens: int, tokens_per_request: int = 8, target: str = "embedded",
                 dtype: str = "auto", context: int = 128, device: str | None = None):
    """`step_fn(batch_tokens)` over `target` ('embedded' SmolLM2, 'tiny', or a local HF model directory;
    dtype auto = bf16 where it is native, else fp32). Keywords come from `--factory-arg KEY=VALUE`."""
    if tokens_per_request < 1 or max_batch_tokens < 1 or context < 1:
        raise ValueError(f"need tokens_per_request, max_batch_tokens and context >= 1, got "
                         f"{tokens_per_request}, {max_batch_tokens}, {context}")
    adapter = _load_adapter(str(target), dtype, device)
    if context + tokens_per_request > adapter.max_context:
        raise ValueError(f"context {context} + {tokens_per_request} verify tokens exceeds the target's "
                         f"{adapter.max_context}; pass a smaller --factory-arg context=N")
    rows = math.ceil(max_batch_tokens / tokens_per_request)
    adapter.reset(rows, capacity=context + tokens_per_request)
    vocab = adapter.geometry.vocab_size
    gen = torch.Generator().manual_seed(0)
    # prefill in chunks of requests so a large max_batch_tokens does not build one huge forward
    chunk = max(1, 4096 // context)
    for start in range(0, rows, chunk):
        ids = torch.arange(start, min(rows, start + chunk))
        adapter.extend(torch.randint(3, vocab, (ids.numel(), context), generator=gen), rows=ids)
    verify = torch.randint(3, vocab, (rows, tokens_per_request), generator=gen)
    sync = torch.cuda.synchronize if adapter.device.type == "cuda" else (lambda: None)

    def step_fn(batch_tokens: int) -> None:
        if not 1 <= batch_tokens <= rows * tokens_per_request:
            raise ValueError(f"batch_tokens {batch_tokens} is outside 1..{rows * tokens_per_request}; "
                             "raise --max-batch-tokens or drop the probe")
        n = math.ceil(batch_tokens / tokens_per_request)
        width = math.ceil(batch_tokens / n)
        adapter.extend(verify[:n, :width], rows=torch.arange(n), commit=False)
        sync()

    step_fn.adapter = adapter  # for inspection (tests, notebooks)
    return step_fn
