"""`HSpecDraftModel`: SGLang's model class for H-Spec drafter checkpoints (docs/architecture.md, "One request through the SGLang worker", "Checkpoint format").

A thin adapter around sglang_hspec.model.DraftModel (one source of truth for the math). SGLang builds it
from the drafter's `config.json` (`architectures: ["HSpecDraftModel"]`, the `hspec` section) and feeds it
`model.safetensors` exactly as `save_drafter` wrote it. It keeps DSpark's draft-model contract, so the
inherited DSpark proposer, sampler, planner and verify run unchanged:

- `forward` runs the drafter's own block forward (`DraftModel.backbone`) over the block rows of a
  TARGET_VERIFY batch: Mamba-2 from the state projected from the request's context row (`ContextState`,
  written at prefill and verify commit), attention over the target's own KV pool read in place
  (`PagedKVWindow`, sglang_hspec/kernels) plus the block's keys, positions continued from the
  committed prefix; it returns the final-normed hidden rows;
- the heads work over the draft vocabulary: `compute_base_logits` multiplies by the LM head's V_d
  draft rows only (the drafter's cached `_draft_lm_weight`), and `markov_head` (`DraftVocabMarkov`)
  is the drafter's own low-rank head over V_d. DSpark's sampler picks target ids by column and its
  verify reads q over the target vocabulary, so both are laid out over V through d2t (columns outside
  the draft vocabulary: base logit -inf, bias 0): the drafter proposes exactly the tokens it proposes
  in our engine. `confidence_head` is SGLang's `DSparkConfidenceHead`, filled from the drafter's.

Imports SGLang: imported only from the worker inside the scheduler process (and SGLang tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod
from sglang.srt.models.dspark import (
    BaseDSparkMarkovHead,
    build_confidence_head,
    gather_and_crop_vocab,
    project_through_lm_head,
)
from sglang.srt.speculative.dspark_components.dspark_config import get_dspark_sample_from_anchor
from torch import nn

from sglang_hspec.kernels import FP8_DTYPES, PagedKVWindow
from sglang_hspec.model.checkpoint import load_state_strict, sglang_capture_ids
from sglang_hspec.model.config import HSpecConfig
from sglang_hspec.model.hspec import DraftModel
from sglang_hspec.model.ssd import scan_backend
from sglang_hspec.model.tensor_parallel import kv_head_range, local_kv_heads, shard_drafter

ARCHITECTURE = "HSpecDraftModel"
logger = logging.getLogger(__name__)


def _hspec_section(config) -> dict:
    section = getattr(config, "hspec", None)
    if not isinstance(section, dict):
        raise ValueError("the drafter's config.json has no 'hspec' section; write H-Spec drafters with "
                         "sglang_hspec.model.checkpoint.save_drafter")
    return section


def _plain_lm_head(lm_head: nn.Module) -> bool:
    """An unquantized, unsharded LM head, whose draft-vocabulary rows can be gathered once and multiplied
    alone. SGLang's ParallelLMHead carries `UnquantizedEmbeddingMethod` when it is not quantized (not None)."""
    method = getattr(lm_head, "quant_method", None)
    return (method is None or type(method) is UnquantizedEmbeddingMethod) and int(getattr(lm_head, "tp_size", 1)) == 1


def tensor_parallel_group() -> tuple[int, int, object]:
    """(rank, world size, all-reduce) of SGLang's TP group, which the draft runner shares with the target
    (without DP attention, `resolve_draft_parallel_layout` gives the drafter no group of its own); (0, 1,
    None) outside a server, and under the GPU check's SGLang stand-ins (scripts/gpu_check.py), which lack
    sglang.srt.distributed."""
    try:
        from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce
        from sglang.srt.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
            model_parallel_is_initialized,
        )
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("sglang.srt"):
            raise
        return 0, 1, None
    if not model_parallel_is_initialized():
        return 0, 1, None
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), tensor_model_parallel_all_reduce


class DraftVocabMarkov(BaseDSparkMarkovHead):
    """DSpark's Markov-head contract over the drafter's own draft-vocabulary head (W1 [V_d + 1, r] by
    draft id, W2 [r -> V_d]): previous target ids map through t2d (ids outside the draft vocabulary
    share W1's spare row), the V_d bias is laid out over the target vocabulary through d2t (0 elsewhere,
    where the base logit is -inf). No [V, r] copies of the weights."""

    def __init__(self, drafter: DraftModel):
        super().__init__()
        self.vocab_size = drafter.config.target.vocab_size
        self.markov_rank = drafter.config.markov_rank
        self._drafter = (drafter,)  # not a child: the weights belong to (and load with) the drafter

    def get_prev_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        d = self._drafter[0]
        return d.markov.markov_w1(d.target_to_draft()[token_ids.long()])

    def step_bias(self, prev_tokens, *, hidden_states, state):
        d = self._drafter[0]
        bias = d.markov.markov_w2(self.get_prev_embeddings(prev_tokens))  # [bs, V_d]
        full = bias.new_zeros(*bias.shape[:-1], self.vocab_size)
        return full.index_copy_(-1, d.d2t, bias), state

    def step_logits_dtype(self, base_dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(base_dtype, self._drafter[0].markov.markov_w1.weight.dtype)


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
        self.block_size = cfg.block_size
        self.markov_head = DraftVocabMarkov(self.drafter)
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
        self.context_state = None  # ContextState, set by HSpecWorkerV2
        self._target_kv_pool = None
        self._req_to_token: torch.Tensor | None = None
        self._kv_scale_layers: dict[int, nn.Module] = {}

    # ---- DSpark draft-model contract ----
    def attach_shared_modules(self, *, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.drafter._target = (embed_tokens, lm_head)
        if _plain_lm_head(lm_head) and lm_head.weight.device.type != "meta":
            self.drafter._draft_lm_weight()  # gather the V_d head rows now, not inside a captured graph

    def forward_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def prune_to_ctx_kv_injection(self) -> None:
        """Nothing to prune: the drafter keeps no KV of its own (DSpark calls this on PD prefill)."""

    def draft_vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base logits [N, V_d] of the final-normed draft rows: the LM head's draft-vocabulary rows only
        (a quantized or vocabulary-sharded head projects whole, then keeps the d2t columns)."""
        if self.lm_head is None:
            raise RuntimeError("HSpecDraftModel needs the target lm_head (attach_shared_modules)")
        h = hidden if not self.logits_mup_width_multiplier else hidden / self.logits_mup_width_multiplier
        d = self.drafter
        if _plain_lm_head(self.lm_head):
            w, b = d._draft_lm_weight()  # [V_d, d] rows, gathered once
            return F.linear(h.to(w.dtype), w, b)
        local = project_through_lm_head(h, self.lm_head)
        full = gather_and_crop_vocab(local, self.lm_head) if int(getattr(self.lm_head, "tp_size", 1)) > 1 else local
        return full.index_select(-1, d.d2t)

    def compute_base_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft-vocabulary base logits laid out over the target vocabulary (-inf outside it: DSpark's
        sampler picks target ids by column), and the confidence features (the same rows)."""
        draft = self.draft_vocab_logits(hidden)
        full = draft.new_full((*draft.shape[:-1], self.hspec_config.target.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.drafter.d2t, draft), hidden

    def compute_confidence(self, *, anchor_tokens, draft_tokens, confidence_features):
        return self.confidence_head.predict(confidence_features, anchor_tokens=anchor_tokens,
                                            draft_tokens=draft_tokens, markov_head=self.markov_head)

    # ---- context ----
    @torch.no_grad()
    def project_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """Captured target hidden rows [n, K*H] (SGLang's packing) -> context rows [n, fusion_rank]: the
        drafter's StateProjection up to its fused rank; `forward` applies the rank -> state step."""
        proj = self.drafter.state_proj
        if proj is None:
            return hidden.new_zeros(hidden.shape[0], self.hspec_config.fusion_rank)
        H = self.hspec_config.hidden_size
        rows = hidden.view(hidden.shape[0], -1, H).index_select(1, self._hidden_columns)  # [n, 5, H]
        return proj.fused(rows)

    def bind_target_kv(self, target_pool, req_to_token: torch.Tensor, *, target_model: nn.Module | None = None) -> None:
        """Read attention context from the target's KV pool (called before the attention backends are
        built). Checks that every mapped target layer has the drafter's KV geometry and a dtype the
        drafter can read; an FP8 pool also needs `target_model`, whose attention layers hold the
        per-layer k/v scales (SGLang's RadixAttention.k_scale_float / v_scale_float)."""
        t = self.hspec_config.target
        if getattr(target_pool, "is_quantized_kv_cache", False):
            raise ValueError("HSPEC reads the target KV pool in place and supports --kv-cache-dtype auto, bf16, "
                             "fp8_e4m3 and fp8_e5m2, not block-scaled FP4/MXFP8 pools; pick one of those")
        fp8 = False
        heads = local_kv_heads(t.num_key_value_heads, self.drafter)  # this rank's shard under TP
        for layer_id in self.drafter.kv_layer_ids:
            buffer = target_pool.get_key_buffer(layer_id)
            shape = tuple(buffer.shape[1:])
            if shape != (heads, t.head_dim):
                raise ValueError(f"target KV layer {layer_id} stores [kv_heads, head_dim] = {shape}, the "
                                 f"drafter expects {(heads, t.head_dim)} ({t.num_key_value_heads} KV heads over "
                                 f"{getattr(self.drafter, 'tp_size', 1)} tensor-parallel ranks)")
            if not (buffer.dtype.is_floating_point and buffer.dtype.itemsize >= 2) and buffer.dtype not in FP8_DTYPES:
                raise ValueError(f"target KV layer {layer_id} is stored as {buffer.dtype}, which the drafter cannot "
                                 "read; serve with --kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2")
            fp8 = fp8 or buffer.dtype in FP8_DTYPES
        self._kv_scale_layers = {}
        if fp8:
            if target_model is None:
                raise ValueError("the target KV pool is FP8: pass target_model to bind_target_kv so the drafter "
                                 "reads the target's k/v scales")
            from sglang.srt.layers.radix_attention import RadixAttention

            layers = {m.layer_id: m for m in target_model.modules() if isinstance(m, RadixAttention)}
            missing = [i for i in self.drafter.kv_layer_ids if i not in layers]
            if missing:
                raise ValueError(f"FP8 KV pool: the target model has no RadixAttention with layer_id {missing}, "
                                 "so their k/v scales are unknown; serve with --kv-cache-dtype auto")
            self._kv_scale_layers = {i: layers[i] for i in self.drafter.kv_layer_ids}
        self._target_kv_pool = target_pool
        self._req_to_token = req_to_token

    def _kv_scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of a target layer's KV, by the rule SGLang's attention backends read them
        with (triton_backend: the *_scale_float values when k_scale and v_scale are set, else 1.0). Read
        per forward: the target's weight loading may set them after bind_target_kv."""
        layer = self._kv_scale_layers.get(layer_id)
        if layer is None or layer.k_scale is None or layer.v_scale is None:
            return 1.0, 1.0
        return float(layer.k_scale_float or 1.0), float(layer.v_scale_float or 1.0)

    # ---- forward: the block rows of a TARGET_VERIFY batch ----
    # no_grad as SGLang's models carry it (Qwen2/Qwen3/LlamaForCausalLM.forward): SGLang's graph runner calls
    # forward as is (runner/decode_cuda_graph_runner.py `capture_one_shape`), and in grad mode the Mamba block
    # would pick the training scan (model/ssd.py `mamba_block`), which SGLang's environment does not have
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: torch.Tensor | None = None, **_) -> LogitsProcessorOutput:
        """The drafter's block forward. The block is [anchor, mask x (block_size - 1)] at positions
        n+1..n+block_size (DSpark builds input_ids and positions that way); `backbone` rebuilds the mask
        columns and positions from the anchors and seq_lens, so input_embeds and positions are not read."""
        d = self.drafter
        bs, k = int(forward_batch.batch_size), self.block_size
        anchors = input_ids.view(bs, k)[:, 0]
        req = forward_batch.req_pool_indices[:bs]
        last = forward_batch.seq_lens[:bs].to(torch.long) - 1  # last committed position n
        fused = self.context_state.read(req) if d.state_proj is not None else None
        contexts = {}
        for i, layer_id in enumerate(d.kv_layer_ids):
            # read in place by the attention layer (sglang_hspec/kernels: Triton on CUDA, torch on CPU)
            k_scale, v_scale = self._kv_scales(layer_id)
            contexts[i] = PagedKVWindow(key_buffer=self._target_kv_pool.get_key_buffer(layer_id),
                                        value_buffer=self._target_kv_pool.get_value_buffer(layer_id),
                                        req_to_token=self._req_to_token, req_pool_indices=req, seq_lens=last + 1,
                                        sliding_window=d.sliding_window, k_scale=k_scale, v_scale=v_scale)
        hidden = d.backbone(anchors, last, None, contexts, fused_context=fused).reshape(bs * k, -1)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)

    # ---- weights: exactly save_drafter's model.safetensors ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_state_strict(self.drafter, dict(weights), what="the H-Spec drafter checkpoint (write it with save_drafter)")
        self._fill_confidence_head()
        rank, world_size, all_reduce = tensor_parallel_group()
        # the checkpoint is whole; each rank keeps the attention heads of its KV shard (model/tensor_parallel.py)
        shard_drafter(self.drafter, rank, world_size, all_reduce)
        if world_size > 1:
            heads = kv_head_range(self.hspec_config.target.num_key_value_heads, rank, world_size)
            logger.info("HSPEC: drafter attention sharded over %d TP ranks; rank %d reads KV heads %d..%d of its "
                        "pool, the rest of the drafter is replicated", world_size, rank, heads.start, heads.stop - 1)
        # inference weights, as SGLang's own layers create theirs (Parameter(..., requires_grad=False)): no call
        # path, with or without grad mode, builds an autograd graph through them
        self.requires_grad_(False)
        d = self.drafter
        if self.hspec_config.uses_mamba:  # choose (and log) the Mamba scan at startup: a missing kernel fails here
            scan_backend(device=d.d2t.device, needs_grad=False)
        d.target_to_draft()  # build the t2d map now, not inside the first captured graph

    @torch.no_grad()
    def _fill_confidence_head(self) -> None:
        d = self.drafter
        if self.confidence_head is not None:
            self.confidence_head.proj.weight.copy_(d.confidence.weight)
            self.confidence_head.proj.bias.copy_(d.confidence.bias)


EntryClass = HSpecDraftModel
