"""Plain decoding with continuous batching: the throughput path of `hspec data regenerate`.

`SpeculativeEngine.generate` runs a batch until its longest request ends, so a batch of replies of
mixed length decodes most of its steps with a few rows left (regeneration of 32 ShareGPT prompts x 384
tokens averaged ~50 tokens/s where a full 32-row decode step runs ~180 here). `ContinuousDecoder`
keeps `slots` rows busy instead: when a row's request ends (EOS or max_new_tokens), the next prompt is
prefilled into that row of the ragged KV cache (rows that free up together are prefilled together, in
`TargetAdapter.prefill`'s forwards of a bounded number of tokens, logits at their last token only) and
joins the next decode step.

The decode itself is the engine's plain step: one anchor token per row through `TargetAdapter.extend`,
the next token drawn by `sampling_probs` / `sample_from` (greedy: argmax). Only how requests share
forwards differs, so greedy replies are the engine's with the `none` drafter (tests/engine/
test_continuous.py holds them equal in float64). Sampled draws come from one generator per call,
in step order, so a call with a seed reproduces itself (not the engine's draws).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from sglang_hspec.core.sampling import sample_from, sampling_probs
from sglang_hspec.core.types import SamplingParams
from sglang_hspec.engine.engine import GenerationResult, RequestStats, eos_token_ids_of, with_texts
from sglang_hspec.target.adapter import TargetAdapter


class ContinuousDecoder:
    """Plain decoding of many prompts over `slots` rows at a time (see module docstring); the same
    `generate(prompts, sampling)` call as `SpeculativeEngine` for what regeneration reads."""

    def __init__(self, adapter: TargetAdapter, *, slots: int = 32, eos_token_ids: Sequence[int] | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1 (rows decoded together), got {slots}")
        self.adapter = adapter
        self.slots = int(slots)
        self.eos_token_ids = eos_token_ids_of(adapter, eos_token_ids)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams(), *,
                 progress: bool = False) -> list[GenerationResult]:
        if sampling.stop:
            raise ValueError("ContinuousDecoder does not scan for stop strings: use SpeculativeEngine "
                             "(drafter none) for requests with `stop`")
        prompts = [list(map(int, p)) for p in prompts]
        limit, vocab = self.adapter.max_context, self.adapter.geometry.vocab_size
        for i, p in enumerate(prompts):
            if not p or min(p) < 0 or max(p) >= vocab or len(p) + sampling.max_new_tokens > limit:
                raise ValueError(f"prompt {i}: needs 1 .. {limit - sampling.max_new_tokens} token ids in "
                                 f"[0, {vocab}) (the target's context is {limit}, max_new_tokens "
                                 f"{sampling.max_new_tokens})")
        results = [GenerationResult(i, p, [], "length", RequestStats(block_size=0)) for i, p in enumerate(prompts)]
        if not prompts or sampling.max_new_tokens == 0:
            return with_texts(results, self.adapter.tokenizer)
        adapter, device = self.adapter, self.adapter.device
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        slots = min(self.slots, len(prompts))
        adapter.reset(slots, capacity=max(len(p) for p in prompts) + sampling.max_new_tokens + 2)
        waiting = deque(range(len(prompts)))
        request_of = [-1] * slots  # the request decoding in each row (-1: free)
        anchors = torch.zeros(slots, dtype=torch.long, device=device)  # last drawn token, not yet in the KV
        bar = tqdm(total=len(prompts), disable=not progress, desc="generate", unit="req")

        def draw(logits: torch.Tensor) -> list[int]:
            """The next token of each row from its logits [rows, V]. Greedy takes the argmax directly (the
            first index on ties, as sampling_probs' one-hot): a one-hot over the vocabulary and a multinomial
            draw from it cost 14 % of a 32-row decode step."""
            if sampling.greedy:
                return logits.argmax(-1).tolist()
            return sample_from(sampling_probs(logits, sampling), generator).tolist()

        def emit(row: int, token: int) -> None:
            """Append a drawn token to the row's request; free the row when the request ends."""
            r = results[request_of[row]]
            if not sampling.ignore_eos and token in self.eos_token_ids:
                r.finish_reason = "eos"
            else:
                r.output_ids.append(token)
                if len(r.output_ids) < sampling.max_new_tokens:
                    anchors[row] = token
                    return
            request_of[row] = -1
            bar.update(1)

        def admit(rows: list[int]) -> None:
            """Prefill the next waiting prompts into the free `rows` and draw their first tokens."""
            ids = [waiting.popleft() for _ in rows]
            for row, i in zip(rows, ids):
                request_of[row] = i
            row_index = torch.tensor(rows, device=device)
            adapter.truncate(torch.zeros(len(rows), dtype=torch.long), rows=row_index)  # the row starts over
            out = adapter.prefill([prompts[i] for i in ids], rows=row_index)
            for row, token in zip(rows, draw(out.logits[:, 0])):
                emit(row, token)

        while True:
            free = [row for row in range(slots) if request_of[row] < 0]
            if free and waiting:
                admit(free[: len(waiting)])
            busy = [row for row in range(slots) if request_of[row] >= 0]
            if not busy:
                if waiting:  # every admitted request ended at its first token
                    continue
                break
            # one plain decode step over the busy rows. While at least half the rows are busy, every row runs
            # (an idle one a dummy token at position 0, its length reset to 0 before and after): the forward
            # then reads the cache in place, where a subset of its rows would be copied in every layer
            # (+50 % on a 32-row step; TargetAdapter.extend)
            if 2 * len(busy) >= slots:
                idle = torch.tensor([row for row in range(slots) if request_of[row] < 0], dtype=torch.long,
                                    device=device)
                adapter.truncate(torch.zeros_like(idle), rows=idle)
                drawn = draw(adapter.extend(anchors[:, None]).logits[:, 0])
                adapter.truncate(torch.zeros_like(idle), rows=idle)
                drawn = [drawn[row] for row in busy]
            else:
                row_index = torch.tensor(busy, device=device)
                drawn = draw(adapter.extend(anchors[row_index][:, None], rows=row_index).logits[:, 0])
            for row, token in zip(busy, drawn):
                emit(row, token)
        bar.close()
        return with_texts(results, adapter.tokenizer)
