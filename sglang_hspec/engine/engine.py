"""Reference speculative-decoding engine: batched, lossless, on a Hugging Face target.

One step for the active requests: the drafter proposes block_size tokens per request (with q and raw
confidence logits), a verify-length policy picks l_r <= block_size, the target runs anchor + l_r tokens
in one forward, `accept_block` keeps a prefix and draws the next token, and the KV cache is rolled back
to the accepted length in O(1). Plain decoding is the same loop with the `none` drafter. A switching
policy (`--policy auto`) may skip the drafter for some or all rows of a step; those rows verify only
their anchor, which is exactly a plain decode step.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from sglang_hspec.core.sampling import sample_from, sampling_probs
from sglang_hspec.core.types import DraftContext, Drafter, SamplingParams
from sglang_hspec.engine.verify import accept_block
from sglang_hspec.target.adapter import ExtendOutput, TargetAdapter


@dataclass
class RequestStats:
    block_size: int
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step, bonus included
    verify_lengths: list[int] = field(default_factory=list)  # draft tokens verified per step (l_r)
    slot_attempts: list[int] = field(default_factory=list)  # per draft slot: verified with all earlier kept
    slot_accepts: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.slot_attempts = self.slot_attempts or [0] * self.block_size
        self.slot_accepts = self.slot_accepts or [0] * self.block_size

    @property
    def num_steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, the bonus token included (1.0 = no speculation gain)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def conditional_acceptance(self) -> list[float | None]:
        """alpha_j = P(slot j kept | slots < j kept and slot j verified)."""
        return [a / n if n else None for a, n in zip(self.slot_accepts, self.slot_attempts)]

    def to_dict(self) -> dict:
        return {
            "tau": self.tau,
            "num_steps": self.num_steps,
            "accept_lengths": self.accept_lengths,
            "verify_lengths": self.verify_lengths,
            "conditional_acceptance": self.conditional_acceptance,
            "slot_attempts": self.slot_attempts,
            "slot_accepts": self.slot_accepts,
            "prefill_seconds": self.prefill_seconds,
            "wall_seconds": self.wall_seconds,
        }


@dataclass
class GenerationResult:
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "length" | "eos" | "stop"
    stats: RequestStats
    text: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.output_ids) / self.stats.wall_seconds if self.stats.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "text": self.text,
            "output_ids": self.output_ids,
            "num_prompt_tokens": len(self.prompt_ids),
            "num_output_tokens": len(self.output_ids),
            "finish_reason": self.finish_reason,
            "tokens_per_second": self.tokens_per_second,
            **self.stats.to_dict(),
        }


def full_block_policy(*, block_size: int) -> Callable:
    """Verify every proposed token (the fixed policy)."""

    def plan(*, confidences: torch.Tensor | None, proposal_lengths: torch.Tensor, row_ids, generations):
        return proposal_lengths.clamp_max(block_size)

    return plan


def with_texts(results: list[GenerationResult], tokenizer) -> list[GenerationResult]:
    """Decode each result's output ids into its text (special tokens skipped) when there is a tokenizer."""
    if tokenizer is not None:
        for r in results:
            r.text = tokenizer.decode(r.output_ids, skip_special_tokens=True)
    return results


def eos_token_ids_of(adapter: TargetAdapter, eos_token_ids: Sequence[int] | None = None) -> set[int]:
    """`eos_token_ids` when given, else the target's (generation config first, then model config)."""
    if eos_token_ids is None:
        eos = getattr(adapter.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(adapter.config, "eos_token_id", None)
        eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return set(int(e) for e in eos_token_ids)


def verify_forward(adapter: TargetAdapter, block: torch.Tensor, *, verify_len: torch.Tensor, rows: torch.Tensor,
                   hidden_layer_ids) -> ExtendOutput:
    """The target forward of one step: `block` [B, 1 + lmax] holds each row's anchor and its drafts, row b
    verifying verify_len[b] of them. Commits 1 + verify_len[b] positions per row, like one padded extend.

    A padded forward computes every row at 1 + lmax tokens. When few rows verify drafts (a probe of
    `--policy auto`: 4 of 32 rows at lmax 7 use 60 of 256 tokens, and a CPU forward costs in proportion
    to its tokens) and the padding would cost at least a plain step's tokens, the anchors of all rows run
    first, as the plain decode step itself, and the drafts of the rows that verify any run after them
    over those rows only (reading the anchors' KV just written). Each row's logits are still those of
    its own prefix: the split changes the cost, not which tokens are accepted."""
    b, width = block.shape
    lmax = width - 1
    drafting = (verify_len > 0).nonzero().squeeze(-1)
    if lmax == 0 or (b - drafting.numel()) * lmax < b:
        return adapter.extend(block, num_tokens=1 + verify_len, rows=rows, hidden_layer_ids=hidden_layer_ids)
    first = adapter.extend(block[:, :1], rows=rows, hidden_layer_ids=hidden_layer_ids)
    rest = adapter.extend(block[drafting, 1:], num_tokens=verify_len[drafting], rows=rows[drafting],
                          hidden_layer_ids=hidden_layer_ids)
    logits = first.logits.new_zeros((b, width, first.logits.shape[-1]))
    logits[:, :1] = first.logits
    logits[drafting, 1:] = rest.logits
    hidden = None
    if first.hidden is not None:
        hidden = first.hidden.new_zeros((b, width, *first.hidden.shape[2:]))
        hidden[:, :1] = first.hidden
        hidden[drafting, 1:] = rest.hidden
    return ExtendOutput(logits=logits, hidden=hidden)


class SpeculativeEngine:
    """Batched speculative decoding over a `TargetAdapter` with any `Drafter`."""

    def __init__(
        self,
        adapter: TargetAdapter,
        drafter: Drafter,
        *,
        policy: Callable | None = None,
        confidence_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        confidence_recorder=None,
        eos_token_ids: Sequence[int] | None = None,
    ):
        self.adapter = adapter
        self.drafter = drafter
        adapter.check_layer_ids(list(drafter.target_layer_ids) + list(drafter.kv_layer_ids))
        self.policy = policy or full_block_policy(block_size=drafter.block_size)
        # raw confidence logits [B, block_size] -> per-slot probabilities (STS-calibrated when given)
        self.confidence_transform = confidence_transform or torch.sigmoid
        self.confidence_recorder = confidence_recorder
        self._generate_calls = 0
        self.eos_token_ids = eos_token_ids_of(adapter, eos_token_ids)

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams = SamplingParams(),
        *,
        progress: bool = False,
    ) -> list[GenerationResult]:
        prompts = [list(map(int, p)) for p in prompts]
        self._validate(prompts, sampling)
        block_size = self.drafter.block_size
        results = [GenerationResult(i, p, [], "length", RequestStats(block_size=block_size))
                   for i, p in enumerate(prompts)]
        if not prompts or sampling.max_new_tokens == 0:
            return self._finish_text(results)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.adapter.device).manual_seed(sampling.seed)
        self.drafter.reset()
        adapter, device = self.adapter, self.adapter.device
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        adapter.reset(n, capacity=longest + sampling.max_new_tokens + block_size + 2)
        hidden_ids = list(self.drafter.target_layer_ids)
        t_start = time.perf_counter()

        # drafters with a drafter-side KV cache must see every committed position, drafted or not
        extend_context = getattr(self.drafter, "extend_context", None)
        # the others read the hidden states at the last position only: no [B, prompt, 5, d] copy per call
        reads_new_hidden = extend_context is not None or getattr(self.drafter, "reads_new_hidden", True)
        # prefill (in groups of rows, TargetAdapter.prefill); the first token comes from the last prompt logits
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        out = adapter.prefill(prompts, hidden_layer_ids=hidden_ids, last_hidden_only=not reads_new_hidden)
        last_logits = out.logits[:, 0]
        anchors = sample_from(sampling_probs(last_logits, sampling), generator)
        if not reads_new_hidden:
            last_hidden = out.hidden[:, 0] if out.hidden is not None else None
            new_hidden = None
        else:
            last_hidden = out.hidden[torch.arange(n, device=device), lengths - 1] if out.hidden is not None else None
            new_hidden = out.hidden
        new_hidden_lengths = lengths.clone()
        prefill_seconds = time.perf_counter() - t_start

        histories = [list(p) for p in prompts]
        active = torch.ones(n, dtype=torch.bool)
        # one generation per generate() call: a policy kept across calls must not hand row r's state
        # (stale confidences, age) to the next call's row r
        generations = torch.full((n,), self._generate_calls, dtype=torch.long)
        self._generate_calls += 1
        for i in range(n):
            results[i].stats.prefill_seconds = prefill_seconds
            self._emit(results[i], [int(anchors[i])], sampling, histories, active)

        bar = tqdm(total=sampling.max_new_tokens * n, disable=not progress, desc="generate", unit="tok")
        bar.update(sum(len(r.output_ids) for r in results))
        # a switching policy (auto) first decides whether this step drafts at all, and which rows
        decide = getattr(self.policy, "decide", None)
        observe = getattr(self.policy, "observe", None)
        while bool(active.any()):
            idx = active.nonzero().squeeze(-1)
            ridx = idx.to(device)
            b = idx.shape[0]
            drafted = decide(row_ids=ridx, generations=generations[idx]) if decide else torch.arange(b)
            drafted = drafted.to(device)
            skipped = torch.ones(b, dtype=torch.bool, device=device)
            skipped[drafted] = False
            if extend_context is not None and new_hidden is not None and bool(skipped.any()):
                extend_context(new_hidden[ridx[skipped]], new_hidden_lengths[ridx[skipped]], rows=ridx[skipped])
            verify_len = torch.zeros(b, dtype=torch.long, device=device)
            draft = torch.zeros((b, 0), dtype=torch.long, device=device)
            q = None
            proposal = None
            if drafted.numel():
                didx = ridx[drafted]
                ctx = DraftContext(
                    anchor_tokens=anchors[didx],
                    last_position=adapter.lengths[didx] - 1,
                    target_hidden=None if last_hidden is None else last_hidden[didx],
                    kv_views={lid: adapter.kv_view(lid, window=self.drafter.sliding_window, rows=didx)
                              for lid in self.drafter.kv_layer_ids},
                    token_history=[histories[i] for i in idx[drafted.cpu()].tolist()],
                    row_ids=didx,
                    new_hidden=None if new_hidden is None else new_hidden[didx],
                    new_hidden_lengths=new_hidden_lengths[didx],
                )
                proposal = self.drafter.propose(ctx, sampling, generator)
                d = drafted.numel()
                prop_len = proposal.lengths if proposal.lengths is not None else \
                    torch.full((d,), block_size, dtype=torch.long)
                prop_len = prop_len.to(device)
                confidences = None
                if proposal.confidence_logits is not None:
                    confidences = self.confidence_transform(proposal.confidence_logits.float())
                lengths = self.policy(confidences=confidences, proposal_lengths=prop_len, row_ids=didx,
                                      generations=generations[idx][drafted.cpu()])
                verify_len[drafted] = torch.minimum(lengths.to(device), prop_len)
                # never verify more than can still be emitted (the bonus token counts too)
                remaining = torch.tensor([sampling.max_new_tokens - len(results[i].output_ids) for i in idx.tolist()],
                                         device=device)
                verify_len = torch.minimum(verify_len, (remaining - 1).clamp_min(0))
                lmax = int(verify_len.max().item())
                draft = torch.zeros((b, lmax), dtype=torch.long, device=device)
                draft[drafted] = proposal.tokens[:, :lmax].to(device)
                if proposal.q is not None and lmax:
                    q = torch.zeros((b, lmax, proposal.q.shape[-1]), dtype=torch.float32, device=device)
                    q[drafted] = proposal.q[:, :lmax].to(device).float()

            block = torch.cat([anchors[ridx][:, None], draft], dim=1)
            out = verify_forward(adapter, block, verify_len=verify_len, rows=ridx, hidden_layer_ids=hidden_ids)
            # greedy acceptance reads only the argmax: the logits' is the one-hot's, without building a
            # [B, L, V] one-hot (14 % of a 32-row plain decode step)
            target_probs = out.logits if sampling.greedy else sampling_probs(out.logits, sampling)
            num_acc, next_tok = accept_block(draft_tokens=draft, verify_lengths=verify_len, target_probs=target_probs,
                                             draft_probs=q, greedy=sampling.greedy, generator=generator)
            if observe is not None and drafted.numel():
                observe(row_ids=ridx[drafted], generations=generations[idx][drafted.cpu()],
                        verify_lengths=verify_len[drafted], num_accepted=num_acc[drafted])
            # rollback: keep the anchor and the accepted drafts; the drawn token is the next anchor
            start = adapter.lengths[ridx] - 1 - verify_len
            adapter.truncate(start + 1 + num_acc, rows=ridx)
            anchors[ridx] = next_tok
            if out.hidden is not None:
                if last_hidden is None:
                    last_hidden = torch.zeros((n, *out.hidden.shape[2:]), dtype=out.hidden.dtype, device=device)
                last_hidden[ridx] = out.hidden[torch.arange(b, device=device), num_acc]
                if reads_new_hidden:
                    new_hidden = torch.zeros((n, *out.hidden.shape[1:]), dtype=out.hidden.dtype, device=device)
                    new_hidden[ridx] = out.hidden
            new_hidden_lengths = torch.zeros(n, dtype=torch.long, device=device)
            new_hidden_lengths[ridx] = 1 + num_acc

            if proposal is not None:
                self._record_confidence(proposal.confidence_logits, verify_len[drafted], num_acc[drafted], block_size)
            before = sum(len(r.output_ids) for r in results)
            for j, i in enumerate(idx.tolist()):
                a, vl = int(num_acc[j]), int(verify_len[j])
                st = results[i].stats
                st.accept_lengths.append(a + 1)
                st.verify_lengths.append(vl)
                for s in range(min(vl, a + 1)):
                    st.slot_attempts[s] += 1
                    st.slot_accepts[s] += int(s < a)
                new = draft[j, :a].tolist() + [int(next_tok[j])]
                # the anchor of this step is already emitted; history gains the verified anchor + drafts
                histories[i].append(int(block[j, 0]))
                histories[i].extend(new[:-1])
                self._emit(results[i], new, sampling, histories, active)
            bar.update(sum(len(r.output_ids) for r in results) - before)
        bar.close()
        wall = time.perf_counter() - t_start
        for r in results:
            r.stats.wall_seconds = wall
        return self._finish_text(results)

    # ------------------------------------------------------------------ helpers

    def _validate(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        limit = self.adapter.max_context
        vocab = self.adapter.geometry.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. the chat template's prefix)")
            if len(p) + 1 > limit:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; the target's context is {limit}: shorten the prompt"
                )
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} holds token ids outside the target vocabulary [0, {vocab})")
        needed = max((len(p) for p in prompts), default=0) + sampling.max_new_tokens
        if prompts and needed > limit:
            raise ValueError(
                f"prompt + max_new_tokens = {needed} exceeds the target's context of {limit}: lower max_new_tokens"
            )

    def _emit(self, result: GenerationResult, new_tokens: list[int], sampling: SamplingParams, histories,
              active: torch.Tensor) -> None:
        """Append tokens, honouring EOS, stop strings and max_new_tokens inside a block."""
        for t in new_tokens:
            if not sampling.ignore_eos and t in self.eos_token_ids:
                result.finish_reason = "eos"
                active[result.index] = False
                return
            result.output_ids.append(t)
            if sampling.stop and self._hits_stop(result, sampling.stop):
                result.finish_reason = "stop"
                active[result.index] = False
                return
            if len(result.output_ids) >= sampling.max_new_tokens:
                result.finish_reason = "length"
                active[result.index] = False
                return

    def _hits_stop(self, result: GenerationResult, stops: Sequence[str]) -> bool:
        tok = self.adapter.tokenizer
        if tok is None:
            raise ValueError("stop strings need a tokenizer: build the TargetAdapter with tokenizer=...")
        # only the tail can newly contain a stop string
        longest = max(len(s) for s in stops)
        tail = tok.decode(result.output_ids[-(longest + 8):], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def _finish_text(self, results: list[GenerationResult]) -> list[GenerationResult]:
        return with_texts(results, self.adapter.tokenizer)

    def _record_confidence(self, logits, verify_len, num_acc, block_size) -> None:
        """Every verify with >= 1 draft; a recorder that takes `verify_lens` marks the slots past a shorter
        verify as unobserved, an older one only gets full-block verifies (the only ones it can read)."""
        if self.confidence_recorder is None or logits is None:
            return
        add = self.confidence_recorder.add
        partial_ok = "verify_lens" in inspect.signature(add).parameters
        keep = verify_len > 0 if partial_ok else verify_len == block_size
        if not bool(keep.any()):
            return
        rows = logits[keep.to(logits.device)].float().cpu()
        if partial_ok:  # verify_lens counts the anchor too
            add(rows, num_acc[keep].cpu(), verify_lens=1 + verify_len[keep].cpu())
        else:
            add(rows, num_acc[keep].cpu())
