"""`HSpecDraftModel` (SGLang's model class for our checkpoints) against the reference drafter.

The checkpoint is what `save_drafter` writes; its config.json goes through transformers' AutoConfig as
SGLang loads it. The target context is real: the tiny Qwen3 target's post-RoPE KV cache, scattered
over a paged pool as SGLang's allocator leaves it, and its layer-0 output captured as SGLang packs it.
The adapter's block forward (the drafter's own `backbone`) + its draft-vocabulary heads, driven the way
DSpark's sampler drives them, and SGLang's DSparkConfidenceHead must reproduce `DraftModel.propose`
(greedy tokens, logits, confidence logits) for requests of different lengths; the head never reads the
LM head's rows outside the draft vocabulary; and the whole draft step is CUDA-graph safe (meta device
under tests/model/_graph_guard.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang

PROMPT_LENS = (9, 4, 17)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from sglang_cpu import builders

    root = tmp_path_factory.mktemp("hspec_adapter")
    target = builders.build_tiny_target(root / "target")
    return target, builders.build_hspec_draft(root / "hspec", target)


class _Head(torch.nn.Module):
    """The target lm_head as SGLang's ParallelLMHead presents it on one rank, unquantized: its quant_method
    is SGLang's UnquantizedEmbeddingMethod, not None (a served drafter once projected the whole vocabulary
    because only None counted as unquantized)."""

    def __init__(self, linear):
        from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

        super().__init__()
        self.weight = linear.weight
        self.quant_method = UnquantizedEmbeddingMethod()
        self.org_vocab_size = linear.weight.shape[0]


def _adapter(draft_dir, target, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sglang_hspec.sglang_plugin.draft_model import HSpecDraftModel

    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")  # SGLang builds the confidence head
    config = AutoConfig.from_pretrained(draft_dir)
    model = HSpecDraftModel(config)
    model.load_weights(load_file(str(draft_dir / "model.safetensors")).items())
    model.attach_shared_modules(embed_tokens=target.get_input_embeddings(), lm_head=_Head(target.lm_head))
    return model.eval()


def test_config_reads_as_the_targets_family(checkpoints):
    from transformers import AutoConfig

    _, draft = checkpoints
    raw = json.loads((draft / "config.json").read_text())
    assert raw["model_type"] == "qwen3" and raw["architectures"] == ["HSpecDraftModel"]
    assert raw["sample_from_anchor"] is True
    assert raw["dflash_config"]["target_layer_ids"] == [0]  # 5 ids, all 0: captured once
    cfg = AutoConfig.from_pretrained(draft)
    assert type(cfg).__name__ == "Qwen3Config" and cfg.num_hidden_layers == 4 and cfg.hspec["block_size"] == 3


def test_config_names_the_stored_dtype(checkpoints, tmp_path):
    """config.json carries the dtype of the weights save_drafter stored (SGLang's `_get_and_verify_dtype`
    reads it; absent, it assumes float32), for the default and for an explicit save dtype."""
    from sglang_cpu import builders
    from transformers import AutoConfig

    from sglang_hspec.model.checkpoint import load_drafter, read_checkpoint_weights, save_drafter
    from sglang_hspec.target.geometry import TargetGeometry

    target_dir, draft = checkpoints
    raw = json.loads((draft / "config.json").read_text())
    stored = {t.dtype for t in read_checkpoint_weights(draft).values() if t.is_floating_point()}
    assert stored == {torch.float32} and raw["torch_dtype"] == "float32"
    target = builders.load_target(target_dir)
    model = load_drafter(draft, TargetGeometry.from_hf_config(target.config), target.get_input_embeddings(),
                         target.lm_head)
    save_drafter(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert AutoConfig.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16  # what SGLang reads


@torch.no_grad()
def test_adapter_reproduces_the_reference_drafter_on_a_paged_pool(checkpoints, monkeypatch):
    from sglang_cpu import builders
    from transformers import DynamicCache

    from sglang_hspec.core.types import DraftContext, SamplingParams
    from sglang_hspec.model.checkpoint import load_drafter
    from sglang_hspec.model.hspec import gather_window
    from sglang_hspec.sglang_plugin.context import ContextState
    from sglang_hspec.target.geometry import TargetGeometry
    from sglang_hspec.target.kv_view import dense_window_view

    target_dir, draft_dir = checkpoints
    target = builders.load_target(target_dir)
    ref = load_drafter(draft_dir, TargetGeometry.from_hf_config(target.config), target.get_input_embeddings(),
                       target.lm_head)
    model = _adapter(draft_dir, target, monkeypatch)
    cfg = ref.config
    g = torch.Generator().manual_seed(0)

    # Target context per request: KV of layers 0/1 and the layer-0 output at the last committed position.
    n_layers, kvh, hd, H = 2, cfg.target.num_key_value_heads, cfg.target.head_dim, cfg.hidden_size
    num_slots, max_ctx = 128, 32
    k_buf = [torch.zeros(num_slots, kvh, hd) for _ in range(n_layers)]
    v_buf = [torch.zeros(num_slots, kvh, hd) for _ in range(n_layers)]
    req_to_token = torch.zeros(8, max_ctx, dtype=torch.int32)
    req_rows = torch.tensor([5, 0, 3])
    free = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()  # scattered slots, 0 = padding
    dense_k, dense_v, hidden_last, anchors = [], [], [], []
    for r, n in zip(req_rows.tolist(), PROMPT_LENS):
        ids = torch.randint(0, 1000, (1, n), generator=g)
        cache = DynamicCache()
        out = target(ids, past_key_values=cache, output_hidden_states=True, use_cache=True)
        slots = torch.tensor([free.pop() for _ in range(n)])
        req_to_token[r, :n] = slots.to(torch.int32)
        for L in range(n_layers):
            k_buf[L][slots] = cache.layers[L].keys[0].transpose(0, 1)
            v_buf[L][slots] = cache.layers[L].values[0].transpose(0, 1)
        dense_k.append([cache.layers[L].keys for L in range(n_layers)])
        dense_v.append([cache.layers[L].values for L in range(n_layers)])
        hidden_last.append(out.hidden_states[1][0, -1])  # output of layer 0 at position n - 1
        anchors.append(int(out.logits[0, -1].argmax()))
    seq_lens = torch.tensor(PROMPT_LENS)
    anchors = torch.tensor(anchors)
    bs, k = len(PROMPT_LENS), cfg.block_size

    # Reference: DraftModel.propose over dense per-request caches (one request at a time: own lengths).
    ref_tokens, ref_conf = [], []
    for b in range(bs):
        views = {L: dense_window_view(dense_k[b][L], dense_v[b][L], seq_lens[b:b + 1] - 1, cfg.sliding_window)
                 for L in set(cfg.kv_reuse_layer_ids)}
        ctx = DraftContext(anchor_tokens=anchors[b:b + 1], last_position=seq_lens[b:b + 1] - 1,
                           target_hidden=hidden_last[b].expand(5, H)[None], kv_views=views)
        prop = ref.propose(ctx, SamplingParams())
        ref_tokens.append(prop.tokens[0])
        ref_conf.append(prop.confidence_logits[0])
    ref_tokens, ref_conf = torch.stack(ref_tokens), torch.stack(ref_conf)

    # SGLang side: context rows from the packed capture [n, K*H] (K = 1), forward, SGLang's heads.
    state = ContextState(req_pool_size=8, rank=cfg.fusion_rank, project=model.project_context,
                         device="cpu", dtype=torch.float32)
    state.write(req_rows, torch.stack(hidden_last))
    model.context_state = state
    pool = SimpleNamespace(get_key_buffer=lambda L: k_buf[L], get_value_buffer=lambda L: v_buf[L])
    model.bind_target_kv(pool, req_to_token)
    block_ids = torch.full((bs, k), cfg.mask_token_id)
    block_ids[:, 0] = anchors
    positions = (seq_lens[:, None] + torch.arange(k)).reshape(-1)
    fb = SimpleNamespace(batch_size=bs, req_pool_indices=req_rows, seq_lens=seq_lens)
    hidden = model(block_ids.reshape(-1), positions, fb, input_embeds=target.get_input_embeddings()(
        block_ids.reshape(-1))).hidden_states
    base, features = model.compute_base_logits(hidden)
    base = base.view(bs, k, -1)
    tokens = torch.empty(bs, k, dtype=torch.long)
    prev = anchors
    for j in range(k):  # DSpark's greedy draft: base + Markov step bias, argmax over the vocabulary
        bias, _ = model.markov_head.step_bias(prev, hidden_states=None, state=None)
        logits = base[:, j] + bias
        tokens[:, j] = prev = logits.argmax(-1)
        ref_logits = ref.head_outputs(hidden.view(bs, k, -1)[:, j], tokens[:, j - 1] if j else anchors).logits
        torch.testing.assert_close(logits[:, ref.d2t], ref_logits, rtol=1e-4, atol=1e-4)
        outside = torch.ones(logits.shape[-1], dtype=torch.bool)
        outside[ref.d2t] = False
        assert torch.isneginf(logits[:, outside]).all()  # never proposes outside the draft vocabulary
    assert torch.equal(tokens, ref_tokens)
    _, conf_raw = model.compute_confidence(anchor_tokens=anchors, draft_tokens=tokens, confidence_features=features)
    torch.testing.assert_close(conf_raw, ref_conf, rtol=1e-4, atol=1e-4)

    # The block hidden itself equals the reference backbone's (state injection + paged-KV attention).
    ctx_views = {i: gather_window(dense_window_view(dense_k[0][L], dense_v[0][L], seq_lens[:1] - 1, cfg.sliding_window),
        seq_lens[:1] - 1, cfg.sliding_window) for i, L in enumerate(cfg.kv_reuse_layer_ids)}
    ref_h = ref.backbone(anchors[:1], seq_lens[:1] - 1, hidden_last[0].expand(5, H)[None], ctx_views)
    torch.testing.assert_close(hidden.view(bs, k, -1)[0], ref_h[0], rtol=1e-5, atol=1e-5)


def test_draft_head_reads_only_the_draft_vocabulary_rows(checkpoints, monkeypatch):
    from sglang_cpu import builders

    from sglang_hspec.sglang_plugin import draft_model

    def whole_vocabulary(*_, **__):
        raise AssertionError("an unquantized one-rank LM head was projected over the whole vocabulary")

    monkeypatch.setattr(draft_model, "project_through_lm_head", whole_vocabulary)
    target_dir, draft_dir = checkpoints
    target = builders.load_target(target_dir)
    model = _adapter(draft_dir, target, monkeypatch)
    d2t = model.drafter.d2t
    V, Vd = model.hspec_config.target.vocab_size, d2t.numel()
    assert Vd < V
    poisoned = torch.nn.Linear(target.lm_head.in_features, V, bias=False)
    with torch.no_grad():
        poisoned.weight.fill_(float("nan"))
        poisoned.weight[d2t] = target.lm_head.weight[d2t]  # only the draft rows are real
    model.attach_shared_modules(embed_tokens=target.get_input_embeddings(), lm_head=_Head(poisoned))
    hidden = torch.randn(5, target.lm_head.in_features, generator=torch.Generator().manual_seed(0))
    base, _ = model.compute_base_logits(hidden)
    assert base.shape == (5, V)
    torch.testing.assert_close(base[:, d2t], hidden @ target.lm_head.weight[d2t].T)
    outside = torch.ones(V, dtype=torch.bool)
    outside[d2t] = False
    assert torch.isneginf(base[:, outside]).all()  # no NaN row was multiplied
    bias, _ = model.markov_head.step_bias(torch.tensor([int(d2t[0]), int(outside.nonzero()[0])]),
                                          hidden_states=None, state=None)
    assert bias.shape == (2, V) and (bias[:, outside] == 0).all()
    # the Markov head is the drafter's own V_d head: no [V, rank] copy of W1 / W2
    assert sum(p.numel() for p in model.markov_head.parameters()) == 0


@torch.no_grad()
def test_sglang_draft_step_is_cuda_graph_safe(checkpoints, monkeypatch):
    """forward + base logits + DSpark's Markov steps + confidence on the meta device: no host read, no
    host-to-device copy (what CUDA-graph capture of the draft forward requires)."""
    from model._graph_guard import forbid_host_sync
    from sglang_cpu import builders

    from sglang_hspec.sglang_plugin.context import ContextState

    target_dir, draft_dir = checkpoints
    target = builders.load_target(target_dir)
    model = _adapter(draft_dir, target, monkeypatch).to("meta")
    cfg = model.hspec_config
    t = cfg.target
    meta_head = _Head(torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False, device="meta"))
    model.attach_shared_modules(embed_tokens=torch.nn.Embedding(t.vocab_size, t.hidden_size, device="meta"),
                                lm_head=meta_head)
    bs, k, slots = 4, cfg.block_size, 256
    pool = SimpleNamespace(get_key_buffer=lambda L: torch.empty(slots, t.num_key_value_heads, t.head_dim, device="meta"),
                           get_value_buffer=lambda L: torch.empty(slots, t.num_key_value_heads, t.head_dim, device="meta"))
    model.bind_target_kv(pool, torch.empty(8, 64, dtype=torch.int32, device="meta"))
    model.context_state = ContextState(req_pool_size=8, rank=cfg.fusion_rank, project=model.project_context,
                                       device="meta", dtype=torch.float32)
    fb = SimpleNamespace(batch_size=bs, req_pool_indices=torch.empty(bs, dtype=torch.long, device="meta"),
                         seq_lens=torch.empty(bs, dtype=torch.long, device="meta"))
    ids = torch.empty(bs * k, dtype=torch.long, device="meta")
    with forbid_host_sync():
        hidden = model(ids, torch.empty(bs * k, dtype=torch.long, device="meta"), fb).hidden_states
        base, features = model.compute_base_logits(hidden)
        prev, tokens = ids.view(bs, k)[:, 0], []
        for j in range(k):
            bias, _ = model.markov_head.step_bias(prev, hidden_states=None, state=None)
            prev = (base.view(bs, k, -1)[:, j] + bias).argmax(-1)
            tokens.append(prev)
        conf, _ = model.compute_confidence(anchor_tokens=ids.view(bs, k)[:, 0], draft_tokens=torch.stack(tokens, 1),
                                           confidence_features=features)
    assert hidden.shape == (bs * k, cfg.hidden_size) and conf.shape == (bs, k)
