"""Greedy identity, reported exactly: speculation against plain decoding on the same prompts.

"Same as plain" is a per-prompt token comparison, never a yes/no that hides how far from exact a run
was: `compare_greedy` counts the identical prompts and, for the others, where the first token differs
and by how little the target preferred plain decoding's token there (the logit gap; a near-tie of a
few hundredths is bf16 rounding, a large gap is a bug). In bf16 the two runs differ unless the target
runs batch-invariant (`TargetAdapter(..., batch_invariant=True)`, `--batch-invariant`), see
docs/results.md, "bf16 greedy identity".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_hspec.target.adapter import TargetAdapter


@dataclass(frozen=True)
class Divergence:
    prompt_index: int
    token_index: int  # first output position whose tokens differ (or where one output ended)
    plain_token: int | None  # None: this output ended at token_index without an EOS to name
    spec_token: int | None
    logit_gap: float | None  # target logit of plain's token minus the speculative one's, at token_index


@dataclass(frozen=True)
class GreedyComparison:
    prompts: int
    identical: int
    divergences: tuple[Divergence, ...]

    @property
    def exact(self) -> bool:
        return self.identical == self.prompts

    def label(self) -> str:
        """`8/8` when every output matched; else `5/8 (first diff @9, gap 0.031)`: the earliest divergence."""
        text = f"{self.identical}/{self.prompts}"
        if self.exact:
            return text
        first = min(self.divergences, key=lambda d: d.token_index)
        gap = "" if first.logit_gap is None else f", gap {first.logit_gap:.3g}"
        return f"{text} (first diff @{first.token_index}{gap})"

    def to_dict(self) -> dict:
        return {"identical_prompts": self.identical, "prompts": self.prompts, "identical_to_plain": self.exact,
                "divergences": [d.__dict__ for d in self.divergences]}


def first_difference(plain: Sequence[int], spec: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one output is a prefix), None if equal."""
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            return i
    return None if len(plain) == len(spec) else min(len(plain), len(spec))


@torch.no_grad()
def logit_gap(adapter: TargetAdapter, prompt: Sequence[int], prefix: Sequence[int], plain_token: int,
              spec_token: int) -> float:
    """The target's logit of `plain_token` minus that of `spec_token` after prompt + prefix (one forward)."""
    ids = torch.tensor([list(prompt) + list(prefix)], dtype=torch.long)
    logits = adapter.full_forward(ids, return_logits=True).logits[0, -1]
    return float(logits[plain_token] - logits[spec_token])


def compare_greedy(prompts: Sequence[Sequence[int]], plain_outputs: Sequence[Sequence[int]],
                   spec_outputs: Sequence[Sequence[int]], *, adapter: TargetAdapter | None = None,
                   eos_token_id: int | None = None) -> GreedyComparison:
    """Compare greedy outputs prompt by prompt. With `adapter`, each divergence gets the target's logit gap
    there (an output that ended early counts as having chosen `eos_token_id`; without one, no gap)."""
    if not len(prompts) == len(plain_outputs) == len(spec_outputs):
        raise ValueError(f"compare_greedy: {len(prompts)} prompts, {len(plain_outputs)} plain outputs and "
                         f"{len(spec_outputs)} speculative outputs: give one output of each per prompt")
    divergences = []
    for i, (prompt, plain, spec) in enumerate(zip(prompts, plain_outputs, spec_outputs)):
        at = first_difference(plain, spec)
        if at is None:
            continue
        plain_tok = plain[at] if at < len(plain) else eos_token_id
        spec_tok = spec[at] if at < len(spec) else eos_token_id
        gap = None
        if adapter is not None and plain_tok is not None and spec_tok is not None:
            gap = logit_gap(adapter, prompt, plain[:at], plain_tok, spec_tok)
        divergences.append(Divergence(i, at, plain_tok, spec_tok, gap))
    return GreedyComparison(prompts=len(prompts), identical=len(prompts) - len(divergences),
                            divergences=tuple(divergences))
