"""`hspec export-dspark` on a Llama-family target (SmolLM2's family: no q/k norms of its own) for a dspark
baseline that has them (qk_norm): SGLang's stock DSPARK worker loads the exported drafter and serves the tiny
Llama target on CPU (tests/sglang_cpu), greedy float32. Its output equals the plain server's, and every block
SGLang's DSpark draft model proposed (its per-step record, SGLANG_DSPARK_DEBUG_DUMP=core,reqs: the committed
length, the block's draft tokens) is the block our drafter proposes from the same context and anchor: the
export is exact, q/k norms, fc fold and full-vocabulary Markov head included."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW = 24
IDS = (1, 0, 1, 1, 0)  # two captured layers of three, repeated and unsorted: the exporter folds fc
BLOCK = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from sglang_cpu import builders

    from sglang_hspec.sglang_plugin.export_dspark import export_dspark

    root = tmp_path_factory.mktemp("dspark_llama")
    target = builders.build_tiny_target(root / "target", family="llama")
    ours = builders.build_dspark_baseline(root / "ours", target, target_layer_ids=IDS, block_size=BLOCK)
    return target, ours, export_dspark(ours, root / "exported", tokenizer_from=target)


@torch.no_grad()
def _our_blocks(target_dir, drafter_dir, seqs_and_prefixes, edit=None):
    """Our dspark drafter's greedy block for each (sequence, committed length P): context 0..P-1, anchor seq[P].
    `edit(drafter)` changes the loaded drafter first."""
    from sglang_cpu import builders

    from sglang_hspec.core.types import DraftContext, SamplingParams
    from sglang_hspec.model.checkpoint import load_drafter
    from sglang_hspec.target.geometry import TargetGeometry

    target = builders.load_target(target_dir)
    drafter = load_drafter(drafter_dir, TargetGeometry.from_hf_config(target.config), target.get_input_embeddings(),
                           target.get_output_embeddings(), dtype=torch.float32).eval()
    if edit is not None:
        edit(drafter)
    out = []
    for seq, prefixes in seqs_and_prefixes:
        hidden = target(torch.tensor([seq]), output_hidden_states=True).hidden_states  # [0] = the embeddings
        rows = torch.stack([hidden[i + 1][0] for i in IDS], dim=1)  # [T, 5, d], id L = output of layer L
        for P in prefixes:
            drafter.reset()
            ctx = DraftContext(anchor_tokens=torch.tensor([seq[P]]), last_position=torch.tensor([P - 1]),
                               target_hidden=rows[P - 1][None], row_ids=torch.tensor([0]),
                               new_hidden=rows[:P][None], new_hidden_lengths=torch.tensor([P]))
            out.append(drafter.propose(ctx, SamplingParams()).tokens[0].tolist())
    return out


def test_sglang_dspark_serves_the_exported_llama_drafter_and_proposes_our_blocks(llama, sglang_server):
    from sglang_cpu import builders

    target, ours, exported = llama
    tok = builders.load_tokenizer(target)
    prompts = [tok.encode(p) for p in builders.PROMPTS]
    plain = sglang_server(target, name="llama_plain")
    want = [o["output_ids"] for o in plain.generate(prompts, MAX_NEW)]
    plain.stop()

    srv = sglang_server(target, name="llama_dspark_exported",
                        args=["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(exported)],
                        env_extra={"SGLANG_DSPARK_DEBUG_DUMP": "core,reqs"})
    seen, blocks, cases = 0, [], []
    for prompt, expect in zip(prompts, want):  # one request at a time: each step's record is this request's
        out = srv.generate([prompt], MAX_NEW)[0]
        assert out["output_ids"] == expect
        assert 1.0 <= out["meta_info"]["spec_accept_length"] <= BLOCK + 1
        records = srv.get("/server_info")["internal_states"][0]["dspark_info_record"]["records"]
        seq = prompt + out["output_ids"]
        steps = [r for rec in records[seen:] for r in rec.get("reqs") or ()]
        seen = len(records)
        # the anchor of a step is a committed token: every step's anchor position lies inside the output
        assert steps and all(len(prompt) <= r["prefix_len"] < len(seq) for r in steps), steps
        cases.append((seq, [r["prefix_len"] for r in steps]))
        blocks += [r["draft_tokens"] for r in steps]
    assert len(blocks) >= len(prompts) * MAX_NEW // (BLOCK + 1)
    ours_blocks = _our_blocks(target, ours, cases)
    assert all(len(b) == BLOCK for b in blocks)
    mismatched = [(i, a, b) for i, (a, b) in enumerate(zip(blocks, ours_blocks)) if a != b]
    assert not mismatched, f"{len(mismatched)} of {len(blocks)} blocks differ (index, SGLang, ours): {mismatched[:5]}"

    def unit_qk_norms(drafter):  # what an export that dropped the q/k norm weights would serve
        for layer in drafter.layers:
            layer.attn.q_norm.weight.fill_(1.0)
            layer.attn.k_norm.weight.fill_(1.0)

    # the comparison sees the q/k norms: without their weights the blocks are not SGLang's
    assert _our_blocks(target, ours, cases, edit=unit_qk_norms) != blocks
