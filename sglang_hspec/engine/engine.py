"""Reference speculative-decoding engine: batched, lossless, on a Hugging Face target.

One step for the active requests: the drafter proposes block_size tokens per request (with q and raw
confidence logits), a verify-length policy (`VerifyPolicy`) picks each request's verify_length <=
block_size, the target runs anchor + verify_length tokens in one forward, `accept_block` keeps a
prefix and draws the next token, and the KV cache is rolled back
to the accepted length in O(1). Plain decoding is the same loop with the `none` drafter. A switching
policy (`--policy auto`) may skip the drafter for some or all rows of a step; those rows verify only
their anchor, which is exactly a plain decode step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from sglang_hspec.core.sampling import sample_from, sampling_probs
from sglang_hspec.core.types import DraftContext, Drafter, DraftProposal, SamplingParams, VerifyPolicy
from sglang_hspec.engine.policies import FixedVerifyPolicy
from sglang_hspec.engine.verify import accept_block
from sglang_hspec.target.adapter import ExtendOutput, TargetAdapter


@dataclass
class RequestStats:
    block_size: int
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step, bonus included
    verify_lengths: list[int] = field(default_factory=list)  # draft tokens verified per step (verify_length)
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


def verify_forward(adapter: TargetAdapter, block: torch.Tensor, *, verify_lengths: torch.Tensor,
                   rows: torch.Tensor, hidden_layer_ids) -> ExtendOutput:
    """The target forward of one step: `block` [B, 1 + longest] holds each row's anchor and its drafts,
    row b verifying verify_lengths[b] of them. Commits 1 + verify_lengths[b] positions per row, like one
    padded extend.

    A padded forward computes every row at 1 + longest tokens. When few rows verify drafts (a probe of
    `--policy auto`: 4 of 32 rows at longest 7 use 60 of 256 tokens, and a CPU forward costs in proportion
    to its tokens) and the padding would cost at least a plain step's tokens, the anchors of all rows run
    first, as the plain decode step itself, and the drafts of the rows that verify any run after them
    over those rows only (reading the anchors' KV just written). Each row's logits are still those of
    its own prefix: the split changes the cost, not which tokens are accepted."""
    b, width = block.shape
    longest = width - 1
    drafting = (verify_lengths > 0).nonzero().squeeze(-1)
    if longest == 0 or (b - drafting.numel()) * longest < b:
        return adapter.extend(block, num_tokens=1 + verify_lengths, rows=rows, hidden_layer_ids=hidden_layer_ids)
    first = adapter.extend(block[:, :1], rows=rows, hidden_layer_ids=hidden_layer_ids)
    rest = adapter.extend(block[drafting, 1:], num_tokens=verify_lengths[drafting], rows=rows[drafting],
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


@dataclass
class _Generation:
    """The state of one `generate` call, across its steps."""

    sampling: SamplingParams
    results: list[GenerationResult]
    generator: torch.Generator | None
    hidden_layer_ids: list[int]
    # drafters with a drafter-side KV cache must see every committed position, drafted or not
    extend_context: Callable | None
    # the others read the hidden states at the last position only: no [B, prompt, 5, d] copy per call
    reads_new_hidden: bool
    anchors: torch.Tensor  # [n] the next anchor of every row
    last_hidden: torch.Tensor | None  # [n, num_ids, hidden] at each row's last committed position
    new_hidden: torch.Tensor | None  # [n, L, num_ids, hidden] committed since each row's last propose
    new_hidden_lengths: torch.Tensor  # [n]
    histories: list[list[int]]  # committed token ids per row (the pending anchor excluded)
    active: torch.Tensor  # [n] bool, rows still generating
    generations: torch.Tensor  # [n] long, this call's generation (one per call)
    start_seconds: float


@dataclass
class _Drafts:
    """One step's drafts over the B active rows (rows that did not draft verify only their anchor)."""

    drafted: torch.Tensor  # [D] batch positions that drafted
    verify_lengths: torch.Tensor  # [B] long, draft tokens each row verifies
    tokens: torch.Tensor  # [B, max verify_length] draft tokens (0 past a row's verify length)
    q: torch.Tensor | None  # [B, max verify_length, V] draft distributions, None: one-hot on the tokens
    proposal: DraftProposal | None  # the drafter's proposal for the drafted rows


class SpeculativeEngine:
    """Batched speculative decoding over a `TargetAdapter` with any `Drafter`."""

    def __init__(
        self,
        adapter: TargetAdapter,
        drafter: Drafter,
        *,
        policy: VerifyPolicy | None = None,
        confidence_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        confidence_recorder=None,
        eos_token_ids: Sequence[int] | None = None,
        tree=None,
    ):
        self.adapter = adapter
        self.drafter = drafter
        adapter.check_layer_ids(list(drafter.target_layer_ids) + list(drafter.kv_layer_ids))
        policy = FixedVerifyPolicy(block_size=drafter.block_size) if policy is None else policy
        if not isinstance(policy, VerifyPolicy):
            raise TypeError(f"policy must implement sglang_hspec.core.types.VerifyPolicy (decide, plan, observe), "
                            f"got {type(policy).__name__}; build one with engine.policies.make_policy")
        self.policy = policy
        # raw confidence logits [B, block_size] -> per-slot probabilities (STS-calibrated when given)
        self.confidence_transform = confidence_transform or torch.sigmoid
        self.confidence_recorder = confidence_recorder
        # tree verification (engine/tree.py, a TreeSpec): every step verifies a tree built from one drafter
        # forward instead of the policy's chain, and commits the accepted path
        self.tree = None
        if tree is not None:
            from sglang_hspec.engine.tree import TreeVerifier

            if not isinstance(policy, FixedVerifyPolicy):
                raise ValueError(f"tree verification sizes each step's tree by the confidences itself; it takes "
                                 f"--policy fixed, not {type(policy).__name__}")
            self.tree = TreeVerifier(adapter, drafter, spec=tree, confidence_transform=self.confidence_transform)
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
        results = [GenerationResult(i, p, [], "length", RequestStats(block_size=self.drafter.block_size))
                   for i, p in enumerate(prompts)]
        if not prompts or sampling.max_new_tokens == 0:
            return self._finish_text(results)
        run = self._prefill(prompts, sampling, results)
        bar = tqdm(total=sampling.max_new_tokens * len(prompts), disable=not progress, desc="generate", unit="tok")
        bar.update(sum(len(r.output_ids) for r in results))
        while bool(run.active.any()):
            before = sum(len(r.output_ids) for r in results)
            self._step(run)
            bar.update(sum(len(r.output_ids) for r in results) - before)
        bar.close()
        wall = time.perf_counter() - run.start_seconds
        for r in results:
            r.stats.wall_seconds = wall
        return self._finish_text(results)

    # ------------------------------------------------------------------ the steps of a call

    def _prefill(self, prompts: list[list[int]], sampling: SamplingParams,
                 results: list[GenerationResult]) -> _Generation:
        """Prefill every prompt (in groups of rows, TargetAdapter.prefill) and emit the first token, sampled
        from the last prompt logits."""
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.adapter.device).manual_seed(sampling.seed)
        self.drafter.reset()
        adapter, device = self.adapter, self.adapter.device
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        rows_per_step = self.tree.spec.max_rows if self.tree is not None else self.drafter.block_size
        adapter.reset(n, capacity=longest + sampling.max_new_tokens + rows_per_step + 2)
        hidden_layer_ids = list(self.drafter.target_layer_ids)
        start_seconds = time.perf_counter()
        extend_context = getattr(self.drafter, "extend_context", None)
        reads_new_hidden = extend_context is not None or getattr(self.drafter, "reads_new_hidden", True)
        prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
        out = adapter.prefill(prompts, hidden_layer_ids=hidden_layer_ids, last_hidden_only=not reads_new_hidden)
        anchors = sample_from(sampling_probs(out.logits[:, 0], sampling), generator)
        if not reads_new_hidden:
            last_hidden = out.hidden[:, 0] if out.hidden is not None else None
            new_hidden = None
        else:
            last_hidden = (out.hidden[torch.arange(n, device=device), prompt_lengths - 1] if out.hidden is not None
                           else None)
            new_hidden = out.hidden
        prefill_seconds = time.perf_counter() - start_seconds
        # one generation per generate() call: a policy kept across calls must not hand row r's state
        # (stale confidences, age) to the next call's row r
        generations = torch.full((n,), self._generate_calls, dtype=torch.long)
        self._generate_calls += 1
        run = _Generation(sampling=sampling, results=results, generator=generator, hidden_layer_ids=hidden_layer_ids,
                          extend_context=extend_context, reads_new_hidden=reads_new_hidden, anchors=anchors,
                          last_hidden=last_hidden, new_hidden=new_hidden, new_hidden_lengths=prompt_lengths.clone(),
                          histories=[list(p) for p in prompts], active=torch.ones(n, dtype=torch.bool),
                          generations=generations, start_seconds=start_seconds)
        for i in range(n):
            results[i].stats.prefill_seconds = prefill_seconds
            self._emit(results[i], [int(anchors[i])], sampling, run.histories, run.active)
        return run

    def _step(self, run: _Generation) -> None:
        """One step over the active rows: draft, verify and accept, commit or roll back, record and emit."""
        idx = run.active.nonzero().squeeze(-1)
        rows = idx.to(self.adapter.device)
        if self.tree is not None:
            return self._tree_step(run, idx, rows)
        drafts = self._draft(run, idx, rows)
        block = torch.cat([run.anchors[rows][:, None], drafts.tokens], dim=1)
        num_accepted, next_tokens, out = self._verify(run, block, drafts, rows)
        if drafts.drafted.numel():
            self.policy.observe(row_ids=rows[drafts.drafted], generations=run.generations[idx][drafts.drafted.cpu()],
                                verify_lengths=drafts.verify_lengths[drafts.drafted],
                                num_accepted=num_accepted[drafts.drafted])
        self._commit(run, rows, drafts, num_accepted, next_tokens, out)
        self._record_step(run, idx, block, drafts, num_accepted, next_tokens)

    def _tree_step(self, run: _Generation, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Tree verification's step: draft once, verify the tree, commit the accepted path, emit."""
        adapter = self.adapter
        ctx = DraftContext(
            anchor_tokens=run.anchors[rows], last_position=adapter.lengths[rows] - 1,
            target_hidden=None if run.last_hidden is None else run.last_hidden[rows],
            kv_views={lid: adapter.kv_view(lid, window=self.drafter.sliding_window, rows=rows)
                      for lid in self.drafter.kv_layer_ids},
            token_history=[run.histories[i] for i in idx.tolist()], row_ids=rows)
        # never verify deeper than can still be emitted (the next token counts too)
        max_depths = [max(0, run.sampling.max_new_tokens - len(run.results[i].output_ids) - 1) for i in idx.tolist()]
        trees, out = self.tree.step(ctx, run.sampling, run.generator, rows=rows, max_depths=max_depths)
        if out.last_hidden is not None:
            if run.last_hidden is None:
                run.last_hidden = out.last_hidden.new_zeros((run.active.shape[0], *out.last_hidden.shape[1:]))
            run.last_hidden[rows] = out.last_hidden
        for j, i in enumerate(idx.tolist()):
            accepted = out.accepted_tokens[j]
            st = run.results[i].stats
            st.accept_lengths.append(len(accepted) + 1)
            st.verify_lengths.append(len(trees[j]) - 1)
            run.histories[i].append(int(run.anchors[i]))
            run.histories[i].extend(accepted)
            run.anchors[i] = out.next_tokens[j]
            self._emit(run.results[i], accepted + [int(out.next_tokens[j])], run.sampling, run.histories, run.active)

    def _draft(self, run: _Generation, idx: torch.Tensor, rows: torch.Tensor) -> _Drafts:
        """The policy's choice of the rows that draft, their proposals, and the verify length of every row
        (never more than the tokens it may still emit, the bonus token included)."""
        adapter, device, sampling = self.adapter, self.adapter.device, run.sampling
        b = idx.shape[0]
        drafted = self.policy.decide(row_ids=rows, generations=run.generations[idx]).to(device)
        skipped = torch.ones(b, dtype=torch.bool, device=device)
        skipped[drafted] = False
        if run.extend_context is not None and run.new_hidden is not None and bool(skipped.any()):
            run.extend_context(run.new_hidden[rows[skipped]], run.new_hidden_lengths[rows[skipped]],
                               rows=rows[skipped])
        verify_lengths = torch.zeros(b, dtype=torch.long, device=device)
        tokens = torch.zeros((b, 0), dtype=torch.long, device=device)
        if not drafted.numel():
            return _Drafts(drafted=drafted, verify_lengths=verify_lengths, tokens=tokens, q=None, proposal=None)
        drafted_rows = rows[drafted]
        ctx = DraftContext(
            anchor_tokens=run.anchors[drafted_rows],
            last_position=adapter.lengths[drafted_rows] - 1,
            target_hidden=None if run.last_hidden is None else run.last_hidden[drafted_rows],
            kv_views={lid: adapter.kv_view(lid, window=self.drafter.sliding_window, rows=drafted_rows)
                      for lid in self.drafter.kv_layer_ids},
            token_history=[run.histories[i] for i in idx[drafted.cpu()].tolist()],
            row_ids=drafted_rows,
            new_hidden=None if run.new_hidden is None else run.new_hidden[drafted_rows],
            new_hidden_lengths=run.new_hidden_lengths[drafted_rows],
        )
        proposal = self.drafter.propose(ctx, sampling, run.generator)
        proposal_lengths = proposal.lengths if proposal.lengths is not None else \
            torch.full((drafted.numel(),), self.drafter.block_size, dtype=torch.long)
        proposal_lengths = proposal_lengths.to(device)
        confidences = None
        if proposal.confidence_logits is not None:
            confidences = self.confidence_transform(proposal.confidence_logits.float())
        planned = self.policy.plan(confidences=confidences, proposal_lengths=proposal_lengths, row_ids=drafted_rows,
                                   generations=run.generations[idx][drafted.cpu()])
        verify_lengths[drafted] = torch.minimum(planned.to(device), proposal_lengths)
        # never verify more than can still be emitted (the bonus token counts too)
        remaining = torch.tensor([sampling.max_new_tokens - len(run.results[i].output_ids) for i in idx.tolist()],
                                 device=device)
        verify_lengths = torch.minimum(verify_lengths, (remaining - 1).clamp_min(0))
        longest = int(verify_lengths.max().item())
        tokens = torch.zeros((b, longest), dtype=torch.long, device=device)
        tokens[drafted] = proposal.tokens[:, :longest].to(device)
        q = None
        if proposal.q is not None and longest:
            q = torch.zeros((b, longest, proposal.q.shape[-1]), dtype=torch.float32, device=device)
            q[drafted] = proposal.q[:, :longest].to(device).float()
        return _Drafts(drafted=drafted, verify_lengths=verify_lengths, tokens=tokens, q=q, proposal=proposal)

    def _verify(self, run: _Generation, block: torch.Tensor, drafts: _Drafts, rows: torch.Tensor):
        """(num_accepted [B], next_tokens [B], the target forward's output) of anchor + drafts: the longest
        agreeing prefix (greedy) or rejection sampling, and the next anchor drawn from the target."""
        sampling = run.sampling
        out = verify_forward(self.adapter, block, verify_lengths=drafts.verify_lengths, rows=rows,
                             hidden_layer_ids=run.hidden_layer_ids)
        # greedy acceptance reads only the argmax: the logits' is the one-hot's, without building a
        # [B, L, V] one-hot (14 % of a 32-row plain decode step)
        target_probs = out.logits if sampling.greedy else sampling_probs(out.logits, sampling)
        num_accepted, next_tokens = accept_block(draft_tokens=drafts.tokens, verify_lengths=drafts.verify_lengths,
                                                 target_probs=target_probs, draft_probs=drafts.q,
                                                 greedy=sampling.greedy, generator=run.generator)
        return num_accepted, next_tokens, out

    def _commit(self, run: _Generation, rows: torch.Tensor, drafts: _Drafts, num_accepted: torch.Tensor,
                next_tokens: torch.Tensor, out: ExtendOutput) -> None:
        """Keep the anchor and the accepted drafts in the KV cache, roll back the rest (O(1)); the drawn token
        is the next anchor, and the hidden state of the last accepted row the next step's drafter input."""
        adapter, device = self.adapter, self.adapter.device
        n, b = run.active.shape[0], rows.shape[0]
        start = adapter.lengths[rows] - 1 - drafts.verify_lengths
        adapter.truncate(start + 1 + num_accepted, rows=rows)
        run.anchors[rows] = next_tokens
        if out.hidden is not None:
            if run.last_hidden is None:
                run.last_hidden = torch.zeros((n, *out.hidden.shape[2:]), dtype=out.hidden.dtype, device=device)
            run.last_hidden[rows] = out.hidden[torch.arange(b, device=device), num_accepted]
            if run.reads_new_hidden:
                run.new_hidden = torch.zeros((n, *out.hidden.shape[1:]), dtype=out.hidden.dtype, device=device)
                run.new_hidden[rows] = out.hidden
        run.new_hidden_lengths = torch.zeros(n, dtype=torch.long, device=device)
        run.new_hidden_lengths[rows] = 1 + num_accepted

    def _record_step(self, run: _Generation, idx: torch.Tensor, block: torch.Tensor, drafts: _Drafts,
                     num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """The step's confidences and per-request stats; the committed tokens emitted (EOS, stop strings and
        max_new_tokens end a request inside a block)."""
        if drafts.proposal is not None:
            self._record_confidence(drafts.proposal.confidence_logits, drafts.verify_lengths[drafts.drafted],
                                    num_accepted[drafts.drafted])
        for j, i in enumerate(idx.tolist()):
            accepted, verify_length = int(num_accepted[j]), int(drafts.verify_lengths[j])
            st = run.results[i].stats
            st.accept_lengths.append(accepted + 1)
            st.verify_lengths.append(verify_length)
            for s in range(min(verify_length, accepted + 1)):
                st.slot_attempts[s] += 1
                st.slot_accepts[s] += int(s < accepted)
            new = drafts.tokens[j, :accepted].tolist() + [int(next_tokens[j])]
            # the anchor of this step is already emitted; history gains the verified anchor + drafts
            run.histories[i].append(int(block[j, 0]))
            run.histories[i].extend(new[:-1])
            self._emit(run.results[i], new, run.sampling, run.histories, run.active)

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

    def _record_confidence(self, logits, verify_lengths, num_accepted) -> None:
        """Every verify with >= 1 draft; the slots past a shorter verify are recorded as unobserved."""
        if self.confidence_recorder is None or logits is None:
            return
        keep = verify_lengths > 0
        if not bool(keep.any()):
            return
        self.confidence_recorder.add(logits[keep.to(logits.device)].float().cpu(), num_accepted[keep].cpu(),
                                     verify_lengths=verify_lengths[keep].cpu())


def generate_tree(adapter: TargetAdapter, drafter: Drafter, prompts: Sequence[Sequence[int]],
                  sampling: SamplingParams = SamplingParams(), *, spec=None,
                  confidence_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  eos_token_ids: Sequence[int] | None = None) -> list[GenerationResult]:
    """Speculative decoding with tree verification (`SpeculativeEngine(..., tree=spec)`, engine/tree.py; spec None:
    the default `TreeSpec`): greedy is token-identical to plain decoding and sampling follows the target's law;
    stats.accept_lengths are the tokens committed per step and stats.verify_lengths the draft rows verified."""
    from sglang_hspec.engine.tree import TreeSpec

    engine = SpeculativeEngine(adapter, drafter, confidence_transform=confidence_transform,
                               eos_token_ids=eos_token_ids, tree=TreeSpec() if spec is None else spec)
    return engine.generate(prompts, sampling)
