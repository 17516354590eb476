"""Simple drafters that exercise the engine before (and beside) learned drafters."""

from __future__ import annotations

import torch

from sglang_hspec.core.types import DraftContext, DraftProposal, SamplingParams


class NoDrafter:
    """Proposes nothing: the engine's loop then is plain autoregressive decoding."""

    name = "none"
    block_size = 0
    target_layer_ids: tuple[int, ...] = ()
    kv_layer_ids: tuple[int, ...] = ()
    sliding_window = 1

    def propose(self, ctx: DraftContext, sampling: SamplingParams, generator=None) -> DraftProposal:
        b = ctx.anchor_tokens.shape[0]
        return DraftProposal(tokens=torch.zeros((b, 0), dtype=torch.long, device=ctx.anchor_tokens.device))

    def reset(self) -> None:
        pass


class NGramDrafter:
    """Prompt-lookup decoding: find the most recent earlier occurrence of the last n tokens
    (n = max_ngram .. min_ngram) in the request's history and propose what followed it."""

    name = "ngram"
    target_layer_ids: tuple[int, ...] = ()
    kv_layer_ids: tuple[int, ...] = ()
    sliding_window = 1

    def __init__(self, block_size: int = 7, *, max_ngram: int = 3, min_ngram: int = 1):
        if block_size < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("ngram drafter needs block_size >= 1 and 1 <= min_ngram <= max_ngram")
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def _lookup(self, seq: list[int]) -> list[int]:
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            # most recent earlier match whose continuation exists
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + self.block_size]
        return []

    def propose(self, ctx: DraftContext, sampling: SamplingParams, generator=None) -> DraftProposal:
        if ctx.token_history is None:
            raise ValueError("the ngram drafter needs ctx.token_history")
        b, k = ctx.anchor_tokens.shape[0], self.block_size
        tokens = torch.zeros((b, k), dtype=torch.long)
        lengths = torch.zeros(b, dtype=torch.long)
        anchors = ctx.anchor_tokens.tolist()
        for r, hist in enumerate(ctx.token_history):
            found = self._lookup(list(hist) + [anchors[r]])
            if found:
                tokens[r, : len(found)] = torch.tensor(found)
                lengths[r] = len(found)
        dev = ctx.anchor_tokens.device
        return DraftProposal(tokens=tokens.to(dev), lengths=lengths.to(dev))

    def reset(self) -> None:
        pass


class RandomDrafter:
    """Proposes uniformly random tokens (q uniform): a deliberately bad drafter for lossless tests."""

    name = "random"
    target_layer_ids: tuple[int, ...] = ()
    kv_layer_ids: tuple[int, ...] = ()
    sliding_window = 1

    def __init__(self, vocab_size: int, block_size: int = 4):
        self.vocab_size = vocab_size
        self.block_size = block_size

    def propose(self, ctx: DraftContext, sampling: SamplingParams, generator=None) -> DraftProposal:
        b, k, v = ctx.anchor_tokens.shape[0], self.block_size, self.vocab_size
        tokens = torch.randint(0, v, (b, k), generator=generator)
        q = None if sampling.greedy else torch.full((b, k, v), 1.0 / v)
        return DraftProposal(tokens=tokens, q=q)

    def reset(self) -> None:
        pass


class SkewedDrafter:
    """Samples from a fixed skewed distribution unrelated to the target (bad but not uniform), with a
    proper q, so rejection sampling has both acceptances and residual draws to get right."""

    name = "skewed"
    target_layer_ids: tuple[int, ...] = ()
    kv_layer_ids: tuple[int, ...] = ()
    sliding_window = 1

    def __init__(self, vocab_size: int, block_size: int = 3, *, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(block_size, vocab_size, generator=g) * 2.0
        self.probs = torch.softmax(logits, -1)
        self.vocab_size = vocab_size
        self.block_size = block_size

    def propose(self, ctx: DraftContext, sampling: SamplingParams, generator=None) -> DraftProposal:
        b = ctx.anchor_tokens.shape[0]
        q = self.probs[None].expand(b, -1, -1)
        tokens = torch.multinomial(q.reshape(-1, self.vocab_size), 1, generator=generator).reshape(b, -1)
        return DraftProposal(tokens=tokens, q=q)

    def reset(self) -> None:
        pass


BUILTIN_DRAFTERS = ("none", "ngram")
