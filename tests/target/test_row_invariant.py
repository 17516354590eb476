"""Row-invariant inference (target/row_invariant.py): the linear-shape probe against stand-in GEMMs of known
behaviour, the padded lone row, the mode's verdict on the tiny target under each stand-in, what
`load_target` does with each `batch_invariant` mode, and greedy identity on the embedded target in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang_hspec.assets.tiny import tiny_target
from sglang_hspec.target import row_invariant as ri
from sglang_hspec.target.adapter import TargetAdapter
from tests.target.test_batch_invariance import _causal_mask

REAL_LINEAR = F.linear
SHAPES = ((64, 128), (128, 64))


def _row_wise(x, w, b=None):  # every row computed alone: row-invariant by construction
    return torch.cat([REAL_LINEAR(r[None], w, b) for r in x.reshape(-1, x.shape[-1])]).reshape(*x.shape[:-1], -1)


def _split_sum(x, w, b=None):  # fp32 accumulation over two halves, in another order than a row alone
    h = x.shape[-1] // 2
    out = REAL_LINEAR(x[..., :h].float(), w[:, :h].float()) + REAL_LINEAR(x[..., h:].float(), w[:, h:].float())
    return (out + (b.float() if b is not None else 0)).to(x.dtype)


def _other_kernel_for_one_row(x, w, b=None):  # M = 1 takes its own kernel; M >= 2 rows agree with each other
    return _split_sum(x, w, b) if x.numel() == x.shape[-1] else _row_wise(x, w, b)


def _kernel_by_row_count(x, w, b=None):  # 8 rows and more take another kernel than fewer rows
    return _split_sum(x, w, b) if x.numel() // x.shape[-1] >= 8 else _row_wise(x, w, b)


@pytest.mark.parametrize("gemm,mode", [(_row_wise, "invariant"), (_other_kernel_for_one_row, "pad"),
                                       (_kernel_by_row_count, "varies")])
def test_linear_row_modes_name_each_stand_in_gemm(monkeypatch, gemm, mode):
    monkeypatch.setattr(torch.nn.functional, "linear", gemm)
    assert ri.linear_row_modes(SHAPES, dtype=torch.bfloat16) == {s: mode for s in SHAPES}


def test_padded_row_linear_runs_a_lone_row_as_two_and_leaves_more_rows_alone(monkeypatch):
    seen = []

    def recording(x, w, b=None):
        seen.append(tuple(x.shape))
        return REAL_LINEAR(x, w, b)

    layer = nn.Linear(16, 8, dtype=torch.float64)
    layer.__class__ = ri.PaddedRowLinear
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    monkeypatch.setattr(torch.nn.functional, "linear", recording)
    for shape in ((16,), (1, 16), (1, 1, 16)):
        out = layer(x.reshape(-1, 16)[0].reshape(shape))
        assert out.shape == (*shape[:-1], 8)
        torch.testing.assert_close(out.reshape(8), REAL_LINEAR(x.reshape(-1, 16)[0], layer.weight, layer.bias))
    torch.testing.assert_close(layer(x), REAL_LINEAR(x, layer.weight, layer.bias))
    assert seen == [(2, 16), (2, 16), (2, 16), (3, 4, 16)]


def _tiny_bf16() -> TargetAdapter:
    return TargetAdapter(tiny_target("llama", dtype=torch.bfloat16, num_layers=2))


def test_the_mode_pads_the_layers_a_one_row_kernel_would_break(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "linear", _other_kernel_for_one_row)
    stock = _tiny_bf16()
    assert not ri.verify_matches_decode(stock)  # the stand-in breaks a stock verify against decodes
    adapter = _tiny_bf16()
    assert ri.make_row_invariant(adapter) and adapter.row_invariant
    linears = [m for m in adapter.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is ri.PaddedRowLinear for m in linears)
    assert adapter.model.config._attn_implementation == ri.ROW_INVARIANT_ATTENTION
    assert all(ri.verify_matches_decode(adapter, seed=s, prompt_tokens=20 + s) for s in range(4))


def test_the_mode_leaves_a_machine_it_cannot_fix_as_it_was(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "linear", _kernel_by_row_count)
    adapter = _tiny_bf16()
    before = adapter.model.config._attn_implementation
    assert not ri.make_row_invariant(adapter) and adapter.row_invariant is False
    assert all(type(m) is nn.Linear for m in adapter.model.modules() if isinstance(m, nn.Linear))
    assert adapter.model.config._attn_implementation == before


def test_prefills_keep_sdpa_and_short_forwards_run_the_invariant_attention(monkeypatch):
    calls = []
    monkeypatch.setattr(ri, "batch_invariant_attention", lambda *a, **k: calls.append("sequential") or (a[1], None))
    monkeypatch.setattr(ri, "gemm_attention", lambda *a, **k: calls.append("gemm") or a[0])
    import transformers.integrations.sdpa_attention as sdpa

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append("sdpa") or (a[1], None))
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8, ri.INVARIANT_QUERY_ROWS, ri.INVARIANT_QUERY_ROWS + 1):
            ri.row_invariant_attention(None, torch.zeros(1, 2, rows, 4, dtype=dtype),
                                       torch.zeros(1, 2, 3, 4, dtype=dtype), torch.zeros(1, 2, 3, 4, dtype=dtype), None)
    assert calls == ["sequential"] * 3 + ["sdpa"] + ["gemm"] * 3 + ["sdpa"]


@pytest.mark.parametrize("boolean_mask", [False, True])
def test_gemm_attention_matches_sdpa_within_bf16_rounding(boolean_mask):
    gen = torch.Generator().manual_seed(0)
    h, kv_heads, length, keys, d = 9, 3, 8, 300, 64  # SmolLM2-135M's attention geometry, a verify block
    q, k, v = (torch.randn(2, n, t, d, generator=gen) for n, t in ((h, length), (kv_heads, keys), (kv_heads, keys)))
    mask = _causal_mask(torch.arange(keys - length, keys), keys, torch.float64).expand(2, 1, length, keys)
    ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(
        3, 1), attn_mask=mask, scale=0.125).transpose(1, 2)
    got = ri.gemm_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask == 0 if boolean_mask else mask.bfloat16(),
                            scaling=0.125)
    assert got.shape == (2, length, h, d) and got.dtype == torch.bfloat16
    # SDPA itself in bf16 lands 1.5e-3 off here; this path rounds the scores and probabilities to bf16 once more
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=6e-3)


def test_gemm_attention_row_is_independent_of_other_queries_and_masked_keys_where_the_gemm_is():
    """On this machine's bf16 GEMM, when the probe says its rows are invariant: a verify row (8 queries, keys to
    the block's end) equals the same row decoded alone (keys to its own position), 14 prefixes up to 2,040."""
    if "varies" in ri.linear_row_modes(((64, 448), (448, 64)), dtype=torch.bfloat16).values():
        pytest.skip("this CPU's bf16 GEMM gives rows other bits between row counts")
    gen = torch.Generator().manual_seed(1)
    for prefix in (5, 33, 63, 64, 100, 200, 255, 256, 300, 511, 512, 1000, 1024, 2040):
        keys = prefix + 8
        q = torch.randn(1, 9, 8, 64, generator=gen).bfloat16()
        k, v = (torch.randn(1, 3, keys, 64, generator=gen).bfloat16() for _ in range(2))
        block = ri.gemm_attention(q, k, v, _causal_mask(prefix + torch.arange(8), keys, torch.bfloat16), scaling=0.125)
        for j in range(8):
            n = prefix + j + 1
            alone = ri.gemm_attention(q[:, :, j:j + 1], k[:, :, :n], v[:, :, :n],
                                      _causal_mask(torch.tensor([prefix + j]), n, torch.bfloat16), scaling=0.125)
            assert torch.equal(alone[0, 0], block[0, j]), (prefix, j)


@pytest.mark.parametrize("dtype,mode,applied", [("bf16", "auto", True), ("fp32", "auto", False), ("bf16", "off", False),
                                                ("fp32", "on", True), ("bf16", True, True), ("bf16", False, False)])
def test_load_target_applies_the_mode_where_it_is_asked_for(monkeypatch, capsys, dtype, mode, applied):
    from sglang_hspec.target import loading

    asked = []
    monkeypatch.setattr(ri, "make_row_invariant", lambda adapter: asked.append(adapter.dtype) or True)
    adapter = loading.load_target("tiny", dtype=dtype, batch_invariant=mode)
    assert bool(asked) is applied and adapter.batch_invariant is applied
    assert capsys.readouterr().err == ""


def test_load_target_says_in_one_line_where_identity_cannot_hold(monkeypatch, capsys):
    from sglang_hspec.target import loading

    monkeypatch.setattr(ri, "make_row_invariant", lambda adapter: False)
    adapter = loading.load_target("tiny", dtype="bf16", batch_invariant="auto")
    err = capsys.readouterr().err.strip().splitlines()
    assert adapter.batch_invariant is False and len(err) == 1
    assert "greedy speculation may differ from plain decoding" in err[0] and "--dtype fp32 is exact" in err[0]
    with pytest.raises(ValueError, match=r"--batch-invariant 'sometimes': choose one of auto, on, off"):
        loading.load_target("tiny", dtype="bf16", batch_invariant="sometimes")


@pytest.mark.slow
def test_embedded_bf16_greedy_speculation_is_token_identical_where_the_machine_allows(embedded_dir):
    """The shipped drafter with lookup against plain decoding, bf16 embedded target, 3 MT-Bench prompts x 48 tokens:
    every output identical wherever `make_row_invariant` holds on this machine (on a Zen 4 EPYC it does, with the
    down projection padded; stock bf16 gives 0/8 identical on `make demo` there)."""
    from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
    from sglang_hspec.core.types import SamplingParams
    from sglang_hspec.engine.drafters import NoDrafter
    from sglang_hspec.engine.engine import SpeculativeEngine
    from sglang_hspec.engine.identity import compare_greedy
    from sglang_hspec.engine.loading import load_drafter_spec
    from sglang_hspec.target.adapter import linear_shapes
    from sglang_hspec.target.loading import load_target

    adapter = load_target("embedded", dtype="bf16", batch_invariant="off")
    if "varies" in ri.linear_row_modes(linear_shapes(adapter.model), dtype=torch.bfloat16).values():
        pytest.skip("this CPU's bf16 GEMM gives rows other bits between row counts: no padding helps here")
    assert ri.make_row_invariant(adapter)
    prompts = [chat_input_ids(adapter.tokenizer, it.messages(0)) for it in load_prompts("mtbench", limit=3)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=48)
    plain = SpeculativeEngine(adapter, NoDrafter()).generate(prompts, sampling)
    spec = SpeculativeEngine(adapter, load_drafter_spec("shipped+lookup", adapter)).generate(prompts, sampling)
    assert sum(sum(r.stats.accept_lengths) - r.stats.num_steps for r in spec) > 0
    cmp = compare_greedy(prompts, [r.output_ids for r in plain], [r.output_ids for r in spec])
    assert cmp.exact, cmp.label()


@pytest.mark.slow
def test_embedded_bf16_tree_nodes_read_their_keys_as_a_decode_does(embedded_dir):
    """A 16-node tree over a cache built by plain decoding (MT-Bench prompt 6 + 2 decoded tokens, the tree of a
    `make demo` step: the drafter's chain, a 7-deep lookup branch under the root, one more node under it):
    every node's K/V in every layer equals what decoding its root-to-node path one token at a time writes, bit
    for bit. Read in the tree's own layout (ancestors among masked keys) the lookup branch's depth-4 node's
    layer-22 keys came out one bf16 step away, which moved a `make demo` output; `tree_gemm_attention` reads them
    in line."""
    from sglang_hspec.assets.prompts import chat_input_ids, load_prompts
    from sglang_hspec.target.adapter import linear_shapes
    from sglang_hspec.target.loading import load_target

    adapter = load_target("embedded", dtype="bf16", batch_invariant="off")
    if "varies" in ri.linear_row_modes(linear_shapes(adapter.model), dtype=torch.bfloat16).values():
        pytest.skip("this CPU's bf16 GEMM gives rows other bits between row counts: no padding helps here")
    assert ri.make_row_invariant(adapter)
    prompt = chat_input_ids(adapter.tokenizer, load_prompts("mtbench", limit=8)[6].messages(0))
    decoded = [504, 1573]  # plain decoding's first two tokens
    tokens = [11268, 2240, 436, 253, 719, 253, 719, 253, 2291, 418, 260, 1112, 282, 260, 7280, 253]
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13, 9]

    def decode_from_prompt(extra):
        adapter.reset(1, capacity=len(prompt) + 32)
        adapter.prefill([prompt])
        for t in decoded + extra:
            adapter.extend(torch.tensor([[t]]))

    decode_from_prompt([])
    s = int(adapter.cache.lengths[0])
    adapter.extend_tree(torch.tensor([tokens]), parents=torch.tensor([parents]))
    tree = [(layer.keys[0, :, s:s + 16].clone(), layer.values[0, :, s:s + 16].clone()) for layer in adapter.cache.layers]
    for node in range(16):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        decode_from_prompt([tokens[i] for i in path])
        at = s + len(path) - 1
        for lid, layer in enumerate(adapter.cache.layers):
            assert torch.equal(tree[lid][0][:, node], layer.keys[0, :, at]), (node, lid)
            assert torch.equal(tree[lid][1][:, node], layer.values[0, :, at]), (node, lid)


def test_tree_gemm_attention_gathers_each_off_chain_node_as_a_decode_reads_its_keys():
    """Random bf16 queries, keys and values, two trees over prefixes of 100 and 130 keys: every node's output
    equals `gemm_attention` of that node alone over its keys in line (a decode's layout, no mask), bit for bit,
    and a row's outputs do not depend on the other row of the batch."""
    from sglang_hspec.target.adapter import tree_key_layout

    torch.manual_seed(0)
    heads, kv_heads, dim, m = 9, 3, 64, 16
    parents = torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13, 9],
                            [-1, 0, 0, 2, 2, 1, 5, 6, 7, 8, 3, 3, 0, 12, 13, 14]])
    depth = torch.zeros_like(parents)
    for i in range(1, m):
        depth[:, i] = depth[torch.arange(2), parents[:, i]] + 1
    start = torch.tensor([100, 130])
    t = 130 + m
    q = (2 * torch.randn(2, heads, m, dim)).bfloat16()
    k = (2 * torch.randn(2, kv_heads, t, dim)).bfloat16()
    v = torch.randn(2, kv_heads, t, dim).bfloat16()
    layout = tree_key_layout(parents, depth, start)
    allowed = torch.zeros(2, 1, m, t, dtype=torch.bool)
    for b in range(2):
        allowed[b, :, :, :int(start[b])] = True
        for i in range(m):
            node = i
            while node >= 0:
                allowed[b, 0, i, int(start[b]) + node] = True
                node = int(parents[b, node])
    out = ri.tree_gemm_attention(q, k, v, allowed, layout, scaling=None)
    same = {}
    for b in range(2):
        for i in range(m):
            line = layout.index[b, i][layout.valid[b, i]]
            decode = ri.gemm_attention(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, line], v[b:b + 1, :, line], None,
                                       scaling=None, is_causal=False)
            same[b, i] = torch.equal(out[b, i], decode[0, 0])
    # the chain's nodes run plain gemm_attention, a verify's rows: equal to decodes only where the CPU's bf16
    # GEMM is row-invariant (the condition make_row_invariant checks before this path is ever used)
    if not all(same[b, i] for b in range(2) for i in range(m) if not layout.gathered[b, i]):
        pytest.skip("this CPU's bf16 GEMM gives a verify row other bits than a decode: the path is not used here")
    assert all(same[b, i] for b in range(2) for i in range(m) if layout.gathered[b, i]), same
