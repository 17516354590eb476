"""A `step_fn(batch_tokens)` for `hspec profile-sps`: one TargetAdapter verify forward.

batch_tokens B is spread over ceil(B / tokens_per_request) requests that each verify up to
tokens_per_request (= 1 + k) tokens on top of `context` cached tokens; the KV is written but not
committed, so every probe sees the same context. `target="tiny"` uses the in-code tiny Llama (tests,
smoke runs); any other value is a Hugging Face model path loaded offline.
"""

from __future__ import annotations

import math

import torch

from sglang_hspec.target.adapter import TargetAdapter


def make_step_fn(*, max_batch_tokens: int, tokens_per_request: int = 8, target: str = "tiny",
                 context: int = 128, device: str | None = None):
    if target == "tiny":
        from sglang_hspec.assets.tiny import tiny_target

        model = tiny_target("llama")
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    adapter = TargetAdapter(model.to(device))
    rows = math.ceil(max_batch_tokens / tokens_per_request)
    adapter.reset(rows, capacity=context + tokens_per_request)
    vocab = adapter.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    adapter.extend(torch.randint(3, vocab, (rows, context), generator=gen))
    verify = torch.randint(3, vocab, (rows, tokens_per_request), generator=gen)
    sync = torch.cuda.synchronize if adapter.device.type == "cuda" else (lambda: None)

    def step_fn(batch_tokens: int) -> None:
        if batch_tokens > rows * tokens_per_request:
            raise ValueError(f"batch_tokens {batch_tokens} exceeds max_batch_tokens {max_batch_tokens}")
        n = math.ceil(batch_tokens / tokens_per_request)
        width = min(tokens_per_request, batch_tokens)
        adapter.extend(verify[:n, :width], rows=torch.arange(n), commit=False)
        sync()

    return step_fn
