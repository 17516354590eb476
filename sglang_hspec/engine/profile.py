"""The reference engine's `step_fn` for `hspec profile-sps`: one target verify forward on the TargetAdapter.

A probe of B batch tokens runs n = ceil(B / tokens_per_request) requests of ceil(B / n) tokens each
(exactly B when B is a multiple of tokens_per_request = 1 + k, the usual probe sizes), on top of
`context` cached tokens per request, the way the engine's verify step calls `TargetAdapter.extend`.
The KV is written but never committed, so every probe sees the same context.

The step function also carries `plain_fn(num_reqs)` (a plain decode step: one token for each of
num_reqs requests, hidden states captured as the engine does) and, when a drafter is given,
`draft_fn(num_reqs)` (its propose forward over num_reqs requests on the same cached context): the
columns the speculate-or-decode switch weighs (scheduler/switch.py).
"""

from __future__ import annotations

import math

import torch

from sglang_hspec.target.adapter import TargetAdapter


def _load_adapter(target: str, dtype: str, device: str | None, batch_invariant: str) -> TargetAdapter:
    from sglang_hspec.target.loading import load_target

    return load_target(target, dtype=dtype, device=device or "cpu", batch_invariant=batch_invariant)


def make_step_fn(*, max_batch_tokens: int, tokens_per_request: int = 8, target: str = "embedded",
                 dtype: str = "auto", context: int = 128, device: str | None = None, max_requests: int = 64,
                 drafter: str = "default", batch_invariant: str = "auto"):
    """`step_fn(batch_tokens)` over `target` ('embedded' SmolLM2, 'tiny', or a local HF model directory;
    dtype auto = bf16 where it is faster, else fp32), with `plain_fn` and `draft_fn` for up to
    `max_requests` requests. drafter: 'default' (the shipped one on the embedded target, else none),
    'none', 'shipped' or a checkpoint directory; batch_invariant: the target's row-invariant mode, as the engine
    loads it (auto: on for bf16 on a CPU where it holds), so the table times the forwards the engine will run.
    Keywords come from `--factory-arg KEY=VALUE`."""
    if tokens_per_request < 1 or max_batch_tokens < 1 or context < 1:
        raise ValueError(f"need tokens_per_request, max_batch_tokens and context >= 1, got "
                         f"{tokens_per_request}, {max_batch_tokens}, {context}")
    adapter = _load_adapter(str(target), dtype, device, str(batch_invariant))
    if context + tokens_per_request > adapter.max_context:
        raise ValueError(f"context {context} + {tokens_per_request} verify tokens exceeds the target's "
                         f"{adapter.max_context}; pass a smaller --factory-arg context=N")
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    rows = max(math.ceil(max_batch_tokens / tokens_per_request), max_requests)
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

    draft_model = _load_drafter(drafter, adapter, str(target))
    hidden_ids = list(draft_model.target_layer_ids) if draft_model is not None else []

    def check_requests(num_reqs: int) -> None:
        if not 1 <= num_reqs <= rows:
            raise ValueError(f"{num_reqs} requests is outside 1..{rows}; raise --factory-arg max_requests=N")

    def plain_fn(num_reqs: int) -> None:
        check_requests(num_reqs)
        adapter.extend(verify[:num_reqs, :1], rows=torch.arange(num_reqs), commit=False,
                       hidden_layer_ids=hidden_ids)
        sync()

    step_fn.adapter = adapter  # for inspection (tests, notebooks)
    step_fn.plain_fn = plain_fn
    if draft_model is not None:
        from sglang_hspec.core.types import DraftContext, SamplingParams

        ids = torch.arange(rows, device=adapter.device)
        last = adapter.extend(verify[:, :1], rows=ids, commit=False, hidden_layer_ids=hidden_ids)
        last_hidden = None if last.hidden is None else last.hidden[:, 0]
        greedy = SamplingParams()

        def draft_fn(num_reqs: int) -> None:
            check_requests(num_reqs)
            r = ids[:num_reqs]
            ctx = DraftContext(
                anchor_tokens=verify[:num_reqs, 0].to(adapter.device), last_position=adapter.lengths[r] - 1,
                target_hidden=None if last_hidden is None else last_hidden[:num_reqs],
                kv_views={lid: adapter.kv_view(lid, window=draft_model.sliding_window, rows=r)
                          for lid in draft_model.kv_layer_ids},
                token_history=[[] for _ in range(num_reqs)], row_ids=r)
            with torch.no_grad():
                draft_model.propose(ctx, greedy, None)
            sync()

        step_fn.draft_fn = draft_fn
    return step_fn


def _load_drafter(spec: str, adapter: TargetAdapter, target: str):
    """The drafter whose propose forward is timed, or None ('none', or 'default' off the embedded target)."""
    from sglang_hspec.engine.loading import LOOKUP_SUFFIX, default_drafter_spec, load_drafter_spec

    if spec == "default":
        spec = default_drafter_spec() if target == "embedded" else "none"
    spec = spec.removesuffix(LOOKUP_SUFFIX)  # the lookup is no forward (~40 us of host work per row): time the drafter
    if spec == "none":
        return None
    model = load_drafter_spec(spec, adapter)
    if getattr(model, "kv_layer_ids", None) is None or hasattr(model, "extend_context"):
        raise ValueError(f"--factory-arg drafter={spec}: only drafters without a drafter-side KV cache (hspec) "
                         "can be timed on a bare context; profile dflash/dspark through the engine")
    return model
