"""`HSpecDraftModel`: SGLang's model class for H-Spec drafter checkpoints (sglang-integration.md §5-§8, §11).

A thin adapter around sglang_hspec.model.DraftModel (one source of truth for the math). SGLang builds it
from the drafter's `config.json` (`architectures: ["HSpecDraftModel"]`, the `hspec` section) and feeds it
`model.safetensors` exactly as `save_drafter` wrote it. It keeps DSpark's draft-model contract, so the
inherited DSpark proposer, sampler, planner and verify run unchanged:

- `forward` runs the drafter's layers over the block rows of a TARGET_VERIFY batch: Mamba-2 from the
  state projected from the request's context row (`ContextState`, written at prefill and verify commit),
  attention over the target's own KV pool read in place (`TargetKVView` "thd") plus the block's keys,
  positions continued from the committed prefix; it returns the final-normed hidden rows;
- `markov_head` / `confidence_head` are SGLang's `VanillaMarkov` / `DSparkConfidenceHead` over the full
  target vocabulary, filled from the drafter's draft-vocabulary heads (ids outside the draft vocabulary
  get base logit -inf, so the drafter proposes exactly the tokens it proposes in our engine).

Imports SGLang: imported only from the worker inside the scheduler process (and SGLang tests).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.models.dspark import (
    VanillaMarkov,
    build_confidence_head,
    gather_and_crop_vocab,
    project_through_lm_head,
)
from sglang.srt.speculative.dspark_components.dspark_config import get_dspark_sample_from_anchor
from torch import nn

from sglang_hspec.model.checkpoint import load_state_strict, sglang_capture_ids
from sglang_hspec.model.config import HSpecConfig
from sglang_hspec.model.hspec import DraftModel, gather_window

from .context import pool_kv_view

ARCHITECTURE = "HSpecDraftModel"


def _hspec_section(config) -> dict:
    section = getattr(config, "hspec", None)
    if not isinstance(section, dict):
        raise ValueError("the drafter's config.json has no 'hspec' section; write H-Spec drafters with "
                         "sglang_hspec.model.checkpoint.save_drafter")
    return section


class HSpecDraftModel(nn.Module):
    # DSpark contract flags (dspark_worker_v2: no target-side projection, whole vocabulary logits)
    supports_pre_gather_target_hidden_projection = False
    supports_vocab_parallel_draft_logits = False
    uses_own_vocab_modules = False

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("HSPEC drafters are not quantized; drop the quantization flags for the drafter")
        self.config = config
        cfg = self.hspec_config = HSpecConfig.from_dict(_hspec_section(config))
        if cfg.kind not in ("hspec", "hspec_kv_only", "hspec_last_token_only"):
            raise ValueError(f"HSpecDraftModel serves H-Spec drafters, got kind {cfg.kind!r}")
        if cfg.markov_rank <= 0:
            raise ValueError("SGLang's DSpark runtime needs a Markov head; this drafter has markov_rank 0")
        t = cfg.target
        # Placeholders on the meta device: the real target embedding and LM head arrive through
        # attach_shared_modules (shared, never loaded from the drafter checkpoint).
        embed = nn.Embedding(t.vocab_size, t.hidden_size, device="meta")
        lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False, device="meta")
        self.drafter = DraftModel(cfg, embed, lm_head)
        self.sample_from_anchor = get_dspark_sample_from_anchor(config)
        if not self.sample_from_anchor:
            raise ValueError("H-Spec drafters run with sample_from_anchor true (the anchor row predicts the "
                             "first draft token); fix the drafter's config.json")
        self.gamma = cfg.block_size
        self.markov_head = VanillaMarkov(vocab_size=t.vocab_size, markov_rank=cfg.markov_rank)
        self.confidence_head = build_confidence_head(config)  # None in static verify mode
        if self.confidence_head is not None and not cfg.confidence_head:
            raise ValueError("this H-Spec drafter has no confidence head, which SGLANG_RAGGED_VERIFY_MODE "
                             "cap-accept/compact needs; serve it with the static mode")
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        self.logits_mup_width_multiplier = None
        # SGLang packs the captured layers [tokens, K*H] in layer order, each once; our 5 ids index into it.
        capture = sglang_capture_ids(cfg)
        self.register_buffer("_hidden_columns", torch.tensor([capture.index(i) for i in cfg.target_layer_ids]),
                             persistent=False)
        self.register_buffer("_outside_draft_vocab", torch.zeros(t.vocab_size, dtype=torch.bool),
                             persistent=False)
        self.context_state = None  # ContextState, set by HSpecWorkerV2
        self._target_kv_pool = None
        self._req_to_token: torch.Tensor | None = None

    # ---- DSpark draft-model contract ----
    def attach_shared_modules(self, *, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.drafter._target = (embed_tokens, lm_head)

    def forward_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def prune_to_ctx_kv_injection(self) -> None:
        """Nothing to prune: the drafter keeps no KV of its own (DSpark calls this on PD prefill)."""

    def compute_base_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target LM head over the final-normed draft rows (the drafter's base logits, laid out over the
        whole target vocabulary), and the confidence features (the same rows)."""
        if self.lm_head is None:
            raise RuntimeError("HSpecDraftModel needs the target lm_head (attach_shared_modules)")
        h = hidden if not self.logits_mup_width_multiplier else hidden / self.logits_mup_width_multiplier
        local = project_through_lm_head(h, self.lm_head)
        V = self.hspec_config.target.vocab_size
        # a single-rank head holds the whole (maybe padded) vocabulary: no collective needed
        logits = gather_and_crop_vocab(local, self.lm_head) if int(getattr(self.lm_head, "tp_size", 1)) > 1 \
            else local[..., :V]
        if self.hspec_config.draft_vocab_size < V:
            logits = logits.masked_fill(self._outside_draft_vocab, float("-inf"))
        return logits, hidden

    def compute_confidence(self, *, anchor_tokens, draft_tokens, confidence_features):
        return self.confidence_head.predict(confidence_features, anchor_tokens=anchor_tokens,
                                            draft_tokens=draft_tokens, markov_head=self.markov_head)

    # ---- context ----
    def project_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """Captured target hidden rows [n, K*H] (SGLang's packing) -> context rows [n, fusion_rank]: the
        drafter's StateProjection up to its fused rank; `forward` applies the rank -> state step."""
        proj = self.drafter.state_proj
        if proj is None:
            return hidden.new_zeros(hidden.shape[0], self.hspec_config.fusion_rank)
        H = self.hspec_config.hidden_size
        rows = hidden.view(hidden.shape[0], -1, H).index_select(1, self._hidden_columns)  # [n, 5, H]
        return proj.fused(rows)

    def bind_target_kv(self, target_pool, req_to_token: torch.Tensor) -> None:
        """Read attention context from the target's KV pool (called before the attention backends are
        built). Checks that every mapped target layer has the drafter's KV geometry."""
        t = self.hspec_config.target
        for layer_id in self.drafter.kv_layer_ids:
            shape = tuple(target_pool.get_key_buffer(layer_id).shape[1:])
            if shape != (t.num_key_value_heads, t.head_dim):
                raise ValueError(f"target KV layer {layer_id} stores [kv_heads, head_dim] = {shape}, the "
                                 f"drafter expects {(t.num_key_value_heads, t.head_dim)} (tensor parallelism "
                                 "that shards KV heads is not supported yet)")
        self._target_kv_pool = target_pool
        self._req_to_token = req_to_token

    # ---- forward: the block rows of a TARGET_VERIFY batch ----
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: torch.Tensor | None = None, **_) -> LogitsProcessorOutput:
        d = self.drafter
        bs, k = int(forward_batch.batch_size), self.gamma
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        x = x.view(bs, k, -1).to(d.norm.weight.dtype)
        positions = positions.view(bs, k)
        req = forward_batch.req_pool_indices[:bs]
        last = forward_batch.seq_lens[:bs].to(torch.long) - 1  # last committed position n
        state0 = None
        if self.hspec_config.uses_mamba:
            if d.state_proj is not None:
                state0 = d.state_proj.state(self.context_state.read(req))
            else:
                state0 = d.initial_state(None, bs, x)
        contexts = {}
        window = min(d.window, self._req_to_token.shape[1])
        if last.device.type == "cpu" and bs > 0:
            # On CPU reading the lengths costs no device sync and no graph fixes the shape: gather only the
            # committed positions instead of a mostly-masked 2048-wide window (10x less work at short context).
            window = min(window, int(last.max()) + 1)
        for i, layer_id in enumerate(d.kv_layer_ids):
            view = pool_kv_view(key_buffer=self._target_kv_pool.get_key_buffer(layer_id),
                                value_buffer=self._target_kv_pool.get_value_buffer(layer_id),
                                req_to_token=self._req_to_token, req_pool_indices=req,
                                prefix_lens=last + 1, window=window)
            contexts[i] = gather_window(view, last, d.window)
        hidden = d.run_layers(x, positions, state0, contexts).reshape(bs * k, -1)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)

    # ---- weights: exactly save_drafter's model.safetensors ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_state_strict(self.drafter, dict(weights), what="the H-Spec drafter checkpoint (write it with save_drafter)")
        self._fill_sglang_heads()

    @torch.no_grad()
    def _fill_sglang_heads(self) -> None:
        """Lay the draft-vocabulary heads out over the whole target vocabulary, as DSpark's runtime reads
        them: W1 rows by target id (ids outside the draft vocabulary share W1's spare row), W2 rows zero
        outside the draft vocabulary (their base logit is -inf anyway)."""
        d = self.drafter
        V = self.hspec_config.target.vocab_size
        all_ids = torch.arange(V, device=d.d2t.device)
        self.markov_head.markov_w1.weight.copy_(d.markov.markov_w1.weight[d.to_draft_ids(all_ids)])
        w2 = self.markov_head.markov_w2.weight
        w2.zero_()
        w2[d.d2t] = d.markov.markov_w2.weight.to(w2.dtype)
        outside = torch.ones(V, dtype=torch.bool, device=d.d2t.device)
        outside[d.d2t] = False
        self._outside_draft_vocab.copy_(outside)
        if self.confidence_head is not None:
            self.confidence_head.proj.weight.copy_(d.confidence.weight)
            self.confidence_head.proj.bias.copy_(d.confidence.bias)


EntryClass = HSpecDraftModel
