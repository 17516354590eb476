"""Row-invariant inference: a one-token decode and a k-token verify give a position the same logits, bit for
bit, so that greedy speculation in bf16 is token-identical to plain decoding.

Two things differ between the two forwards on a CPU (docs/results.md, "bf16 greedy identity"):
- *Attention.* Hugging Face's SDPA path packs the GQA groups into the query axis for a one-token decode and
  repeats K/V for a verify; the sums then run in other orders. Forwards of at most `INVARIANT_QUERY_ROWS`
  query rows (decode and verify steps) run `gemm_attention` in half precision (two GEMMs whose rows are the
  queries of a KV head; CPUs' bf16 GEMMs give a row its bits whatever the other rows, where their fp32 ones do
  not) and the sequential fp32 sums of `batch_invariant_attention` (target/adapter.py) in fp32; longer ones
  (prefills, the same for plain and speculative decoding of a prompt) keep SDPA and its speed.
- *Linear layers with one row.* The GEMM library takes another kernel for M = 1 than for M >= 2 at some
  shapes (on a Zen 4 EPYC: only the 1536 -> 576 down projection of the embedded target), while its M >= 2
  rows agree with each other whatever M and wherever the row sits. Such a layer pads a lone row to two
  (`PaddedRowLinear`): the weight is read once either way, so the cost is small.

Whether that makes a machine row-invariant is measured, never assumed: `linear_row_modes` probes every
linear shape of the model (M = 1 against M = 2..16, and M >= 2 rows against each other), and
`verify_matches_decode` runs the model itself: 8 one-token decodes against one 8-token verify of the same
tokens after a 280-token prompt (past the 256-key blocks a GEMM may cut its inner sum at), bit for bit. `make_row_invariant` applies the mode and returns that verdict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_hspec.target.adapter import (
    BATCH_INVARIANT_ATTENTION,
    TREE_KEY_LAYOUT,
    TargetAdapter,
    TreeKeyLayout,
    _register_batch_invariant_attention,
    batch_invariant_attention,
    cancelling_inputs,
    linear_shapes,
)

ROW_INVARIANT_ATTENTION = "hspec_row_invariant"
# forwards with more query rows than this run SDPA: prompt prefills, which plain and speculative decoding
# share, and whose elementwise sequential attention would cost seconds on a long prompt
INVARIANT_QUERY_ROWS = 64
PROBE_ROWS = (2, 3, 8, 9, 16)  # verify blocks (block_size + 1 = 8), trees (16) and odd sizes between


def _attention_scores(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """fp32 scores [B, kv_heads, groups * L, T] of query [B, H, L, D] against key [B, kv_heads, T, D]: the queries of
    a KV head are the rows of one product (head = kv * groups + g: rows ordered (g, position))."""
    b, h, length, d = query.shape
    rows = query.reshape(b, key.shape[1], (h // key.shape[1]) * length, d)
    return torch.matmul(rows, key.transpose(-1, -2)).float().mul_(d ** -0.5 if scaling is None else scaling)


def _attend(scores: torch.Tensor, attention_mask: torch.Tensor | None, value: torch.Tensor, *, heads: int,
            length: int) -> torch.Tensor:
    """Mask (in place), softmax in fp32 row by row, then P @ V in the values' dtype: [B, L, H, D]."""
    b, kv_heads, _, t = scores.shape
    groups, d = heads // kv_heads, value.shape[-1]
    if attention_mask is not None:
        m = attention_mask[..., :t]
        by_group = scores.view(b, kv_heads, groups, length, t)  # the mask broadcasts over heads, no copy
        if m.dtype == torch.bool:
            by_group.masked_fill_(~m[:, :, None], float("-inf"))
        else:
            by_group.add_(m[:, :, None])
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)
    return out.view(b, kv_heads, groups, length, d).reshape(b, heads, length, d).transpose(1, 2)


def gemm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                   *, scaling: float | None, is_causal: bool = True) -> torch.Tensor:
    """Attention as two GEMMs in the inputs' (half-precision) dtype, for CPUs whose bf16 GEMM gives a row the same
    bits whatever the other rows and however many zero-weight keys trail it (`make_row_invariant` checks that on
    the model): the queries of a KV head are the rows of one product, and the softmax runs row by row in fp32 on
    the upcast scores. query [B, H, L, D], key / value [B, kv_heads, T, D], an additive or boolean mask
    [B, 1, L, T]; returns [B, L, H, D]. Few ops on purpose: a decode step runs this once per layer, and on a
    2-core CPU each eager op costs microseconds that add up to a visible share of a 135M model's step."""
    h, length = query.shape[1], query.shape[2]
    t = key.shape[2]
    scores = _attention_scores(query, key, scaling)
    if attention_mask is None and length > 1 and is_causal:
        attention_mask = (torch.arange(t, device=query.device)[None, :]
                          <= torch.arange(t - length, t, device=query.device)[:, None])[None, None]
    return _attend(scores, attention_mask, value, heads=h, length=length)


def tree_gemm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, layout: TreeKeyLayout, *,
                        scaling: float | None) -> torch.Tensor:
    """`gemm_attention` for a tree forward (TargetAdapter.extend_tree): query [B, H, M, D] (node i of row b
    at [b, :, i]), key / value [B, kv, T, D] with node i at time index prefix + i, the tree's mask. A node
    must attend as a one-token decode at its position does. The chain from the root (nodes 0, 1, 2, ... at
    depths 0, 1, 2, ...) reads its keys in line in the tree's own layout, as a verify's rows do. Any other
    node's ancestors sit among other nodes' masked keys there, and its softmax and P @ V sums would run in
    another order and round otherwise in bf16. For those nodes (`layout.gathered`) the scores (one GEMM row
    each, the bits a decode's row gets) are gathered in line (the prefix, then the ancestors and the node),
    and so are the values the probabilities weigh. Returns [B, M, H, D]."""
    b, h, m, d = query.shape
    kv = key.shape[1]
    groups = h // kv
    scores = _attention_scores(query, key, scaling)
    b_sel, i_sel = layout.gathered_nodes
    line_out = None
    if b_sel.numel():  # before `_attend` masks the scores in place
        index, valid = layout.index[b_sel, i_sel], layout.valid[b_sel, i_sel]  # [n, width]
        n, width = index.shape
        line = scores.view(b, kv, groups, m, -1)[b_sel, :, :, i_sel]  # [n, kv, groups, T]
        line = line.gather(-1, index[:, None, None, :].expand(n, kv, groups, width))
        probs = torch.softmax(line.masked_fill_(~valid[:, None, None, :], float("-inf")), dim=-1).to(value.dtype)
        if b == 1:  # one gather of every node's line
            values = value[0].index_select(1, index.reshape(-1)).view(kv, n, width, d).transpose(0, 1)
        else:
            values = value.transpose(1, 2)[b_sel[:, None], index].permute(0, 2, 1, 3)  # [n, kv, width, D]
        line_out = torch.matmul(probs, values).reshape(n, h, d)  # [n, kv, groups, D]: head = kv * groups + g
    out = _attend(scores, attention_mask, value, heads=h, length=m).contiguous()
    if line_out is not None:
        out[b_sel, i_sel] = line_out
    return out


def row_invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs):
    """Hugging Face's attention-function signature: prefills (more than INVARIANT_QUERY_ROWS queries) run SDPA;
    decode and verify forwards run `gemm_attention` in bf16 / fp16 and the sequential fp32 sums of
    `batch_invariant_attention` otherwise."""
    if query.shape[2] > INVARIANT_QUERY_ROWS:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if query.dtype in (torch.bfloat16, torch.float16):
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or kwargs.get("sliding_window"):
            raise ValueError("row-invariant attention supports plain softmax attention only (no softcap, attention "
                             "sinks or sliding window): load the target with batch_invariant='off'")
        if dropout:
            raise ValueError("row-invariant attention is an inference mode: dropout must be 0")
        if TREE_KEY_LAYOUT and TREE_KEY_LAYOUT[-1].index.shape[:2] == (query.shape[0], query.shape[2]):
            return tree_gemm_attention(query, key, value, attention_mask, TREE_KEY_LAYOUT[-1], scaling=scaling), None
        causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
        return gemm_attention(query, key, value, attention_mask, scaling=scaling, is_causal=causal), None
    return batch_invariant_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                     **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _register_batch_invariant_attention()
    AttentionInterface.register(ROW_INVARIANT_ATTENTION, row_invariant_attention)
    AttentionMaskInterface.register(ROW_INVARIANT_ATTENTION, sdpa_mask)


class PaddedRowLinear(nn.Linear):
    """nn.Linear whose lone input row runs as a 2-row GEMM (the row twice), so that it gets the bits it gets
    among other rows. Inputs of more rows run as they are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(1, -1)
        return F.linear(torch.cat([flat, flat]), self.weight, self.bias)[:1].reshape(*x.shape[:-1], -1)


def linear_row_modes(shapes, *, dtype: torch.dtype, device: str | torch.device = "cpu",
                     seed: int = 0) -> dict[tuple[int, int], str]:
    """Per (in_features, out_features): 'invariant' (a row gets the same bits alone or among 2..16 rows),
    'pad' (M >= 2 rows agree with each other whatever M and the row's place, M = 1 does not: pad lone rows)
    or 'varies' (M >= 2 rows differ between row counts or places: no padding helps)."""
    m = max(PROBE_ROWS)
    out = {}
    for in_features, out_features in shapes:
        x, w = cancelling_inputs(in_features, out_features, m, dtype=dtype, device=device,
                                 generator=torch.Generator(device="cpu").manual_seed(seed))
        alone = torch.cat([F.linear(x[r:r + 1], w) for r in range(m)])
        many = F.linear(x, w)
        among = all(torch.equal(F.linear(x[:n], w), many[:n]) for n in PROBE_ROWS)
        # a row's place: each row second of a pair, against its place in the m-row product
        placed = all(torch.equal(F.linear(x[[(r + 1) % m, r]], w)[1], many[r]) for r in range(m))
        if among and placed:
            out[(in_features, out_features)] = "invariant" if torch.equal(alone, many) else "pad"
        else:
            out[(in_features, out_features)] = "varies"
    return out


def verify_matches_decode(adapter: TargetAdapter, *, prompt_tokens: int = 280, block_rows: int = 8,
                          seed: int = 0) -> bool:
    """Whether `block_rows` one-token decodes and one verify forward of the same tokens give every position the
    same logits bit for bit, on the model itself (a seeded synthetic prompt; its cache is reset after)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = adapter.embed_tokens.num_embeddings
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
    adapter.reset(1, capacity=prompt_tokens + block_rows + 1)
    adapter.prefill([prompt])
    tokens, decoded = [], []
    nxt = int(torch.randint(0, vocab, (1,), generator=gen))
    for _ in range(block_rows):
        tokens.append(nxt)
        logits = adapter.extend(torch.tensor([[nxt]])).logits[0, -1]
        decoded.append(logits)
        nxt = int(logits.argmax())
    adapter.truncate(torch.tensor([prompt_tokens]))
    verified = adapter.extend(torch.tensor([tokens])).logits[0]
    adapter.cache = None
    return all(torch.equal(verified[j], decoded[j]) for j in range(block_rows))


def make_row_invariant(adapter: TargetAdapter) -> bool:
    """Switch the adapter's model to row-invariant inference where this machine allows it and say whether a
    verify now matches one-token decodes bit for bit. Where a linear shape 'varies' the mode cannot hold:
    the model is left as it was (its fast path) and the answer is False."""
    model = adapter.model
    modes = linear_row_modes(linear_shapes(model), dtype=adapter.dtype, device=adapter.device)
    if "varies" in modes.values():
        adapter.row_invariant = False
        return False
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ROW_INVARIANT_ATTENTION)
    for module in model.modules():
        if type(module) is nn.Linear and modes[(module.in_features, module.out_features)] == "pad":
            module.__class__ = PaddedRowLinear
    adapter.row_invariant = verify_matches_decode(adapter)
    if not adapter.row_invariant:  # no gain: the fast path back
        restore_fast_path(adapter, attention=previous)
    return adapter.row_invariant


def restore_fast_path(adapter: TargetAdapter, *, attention: str = "sdpa") -> None:
    """Undo `make_row_invariant`: plain nn.Linear layers and `attention` (benchmarks time both paths on one model)."""
    for module in adapter.model.modules():
        if type(module) is PaddedRowLinear:
            module.__class__ = nn.Linear
    adapter.model.set_attn_implementation(attention if attention not in (BATCH_INVARIANT_ATTENTION,
                                                                         ROW_INVARIANT_ATTENTION) else "sdpa")
    adapter.row_invariant = False
