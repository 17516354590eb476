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


def latest_match(seq: list[int], *, max_ngram: int, min_ngram: int) -> tuple[int, int] | None:
    """(start, n) of the most recent earlier occurrence of seq's last n tokens, longest n first (n =
    max_ngram .. min_ngram), that has at least one token after it; None when there is none."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                return start, n
    return None


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
        match = latest_match(seq, max_ngram=self.max_ngram, min_ngram=self.min_ngram)
        if match is None:
            return []
        start, n = match
        return seq[start + n:start + n + self.block_size]

    def propose(self, ctx: DraftContext, sampling: SamplingParams, generator=None) -> DraftProposal:
        if ctx.token_history is None:
            raise ValueError("the ngram drafter needs ctx.token_history")
        b, block_size = ctx.anchor_tokens.shape[0], self.block_size
        tokens = torch.zeros((b, block_size), dtype=torch.long)
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
        b, block_size, v = ctx.anchor_tokens.shape[0], self.block_size, self.vocab_size
        tokens = torch.randint(0, v, (b, block_size), generator=generator)
        q = None if sampling.greedy else torch.full((b, block_size, v), 1.0 / v)
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


# the confidence given to spliced slots (after slot 1): on the embedded target's held-out prompts they are kept
# 0.78 of the time (docs/results.md, "Prompt lookup spliced into the drafter")
LOOKUP_CONFIDENCE = 0.8


class PromptLookup:
    """Prompt lookup for splicing: block_size tokens copied from after the most recent earlier occurrence
    of a sequence's last n tokens (longest n first). The copy may run into the tokens it has just copied
    (as LZ77 does), so a loop of period p continues for the whole block, not p tokens."""

    def __init__(self, block_size: int, *, max_ngram: int = 3, min_ngram: int = 1):
        if block_size < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs block_size >= 1 and 1 <= min_ngram <= max_ngram, got "
                             f"{block_size}, {min_ngram}, {max_ngram}")
        self.block_size, self.max_ngram, self.min_ngram = block_size, max_ngram, min_ngram

    def continuation(self, seq: list[int]) -> list[int]:
        """block_size tokens, or [] when no earlier occurrence of any tail of seq exists."""
        match = latest_match(seq, max_ngram=self.max_ngram, min_ngram=self.min_ngram)
        if match is None:
            return []
        start, n = match
        copied = list(seq)
        for pos in range(start + n, start + n + self.block_size):
            copied.append(copied[pos])
        return copied[len(seq):]

    def continuations(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's continuation [B, block_size] (zeros where none) and whether it found one [B]."""
        looked = torch.zeros((len(seqs), self.block_size), dtype=torch.long)
        found = torch.zeros(len(seqs), dtype=torch.bool)
        for r, seq in enumerate(seqs):
            cont = self.continuation(seq)
            if cont:
                looked[r] = torch.tensor(cont)
                found[r] = True
        return looked, found


def splice_lookup(*, drafted: torch.Tensor, looked: torch.Tensor, found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks [B, k] with slots 2..k taken from the lookup where its first token is the drafter's own
    slot-1 token, and that mask [B]. Shared by the engine (LookupSpliceDrafter) and the SGLang worker."""
    splice = found & (looked[:, 0] == drafted[:, 0])
    return torch.where(splice[:, None], looked.to(drafted.dtype), drafted), splice


class LookupSpliceDrafter:
    """A learned drafter with prompt lookup spliced in (PromptLookup over the history and the anchor):
    where the lookup's first token is the drafter's own slot-1 token, the rest of the block is the
    lookup's copy. A lookup that agrees with the drafter on slot 1 is seldom a coincidence, and once
    right it runs on far longer than a block-parallel drafter (docs/results.md, "Prompt lookup spliced
    into the drafter"). Other rows keep the drafter's block. The lookup reads only the history, never
    the drafter's output, so a server can compute it while the drafter runs and splice without a device
    sync. Lossless at any temperature: slot 1 is the drafter's own draw under its own q, and given that
    token every spliced slot is a deterministic function of the history, so its q is one-hot."""

    def __init__(self, drafter, *, max_ngram: int = 3, min_ngram: int = 1,
                 lookup_confidence: float = LOOKUP_CONFIDENCE):
        if getattr(drafter, "extend_context", None) is not None:
            raise ValueError(f"lookup splicing needs a drafter without a drafter-side KV cache; {drafter.name} has one")
        if not 0.0 < lookup_confidence < 1.0:
            raise ValueError(f"lookup_confidence must lie in (0, 1), got {lookup_confidence}")
        self.drafter = drafter
        self.lookup = PromptLookup(drafter.block_size, max_ngram=max_ngram, min_ngram=min_ngram)
        self.name = f"{drafter.name}+lookup"
        self.block_size = drafter.block_size
        self.target_layer_ids = drafter.target_layer_ids
        self.kv_layer_ids = drafter.kv_layer_ids
        self.sliding_window = drafter.sliding_window
        self.reads_new_hidden = getattr(drafter, "reads_new_hidden", True)
        # raw confidence logit of spliced slots (the verify-length scheduler and STS read logits)
        self.lookup_confidence = lookup_confidence
        self.lookup_logit = float(torch.logit(torch.tensor(lookup_confidence, dtype=torch.float64)))
        self.spliced_rows = 0  # rows whose block came (after slot 1) from the lookup, since reset
        self.proposed_rows = 0
        self.last_spliced = torch.zeros(0, dtype=torch.bool)  # [B] of the latest propose

    def propose(self, ctx: DraftContext, sampling: SamplingParams, generator=None) -> DraftProposal:
        if ctx.token_history is None:
            raise ValueError("lookup splicing needs ctx.token_history")
        looked, found = self.lookup.continuations(
            [list(hist) + [anchor] for hist, anchor in zip(ctx.token_history, ctx.anchor_tokens.tolist())])
        proposal = self.drafter.propose(ctx, sampling, generator)
        drafted = proposal.tokens
        b, block_size = drafted.shape
        tokens, splice = splice_lookup(drafted=drafted, looked=looked.to(drafted.device), found=found.to(drafted.device))
        self.proposed_rows += b
        self.spliced_rows += int(splice.sum())
        self.last_spliced = splice.cpu()
        if not bool(splice.any()):
            return proposal
        lengths = None
        if proposal.lengths is not None:  # a spliced block is always whole
            lengths = torch.where(splice, block_size, proposal.lengths.to(drafted.device))
        later = splice[:, None] & (torch.arange(block_size, device=drafted.device) >= 1)[None, :]  # slot 1 keeps its q
        q = proposal.q
        if q is not None:
            q = torch.where(later[..., None], torch.nn.functional.one_hot(tokens, q.shape[-1]).to(q.dtype), q)
        conf = proposal.confidence_logits
        if conf is not None:
            conf = torch.where(later, torch.full_like(conf, self.lookup_logit), conf)
        return DraftProposal(tokens=tokens, q=q, confidence_logits=conf, lengths=lengths)

    def reset(self) -> None:
        self.drafter.reset()
        self.spliced_rows = self.proposed_rows = 0
