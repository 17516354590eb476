"""The reference engine's profile-sps step function: the verify forwards it runs, and the CLI wiring."""

import argparse
import json

import pytest
import torch
from sglang_hspec.scheduler.profiler import add_parser, profile_sps

from sglang_hspec.engine.profile import make_step_fn


def test_step_fn_runs_uncommitted_verify_forwards_of_the_asked_size():
    step_fn = make_step_fn(max_batch_tokens=32, tokens_per_request=8, target="tiny", dtype="fp32", context=16,
                           max_requests=4)
    adapter = step_fn.adapter
    assert adapter.dtype == torch.float32 and adapter.lengths.tolist() == [16] * 4
    shapes = []
    extend = adapter.extend
    adapter.extend = lambda tokens, **kw: shapes.append(tuple(tokens.shape)) or extend(tokens, **kw)
    for bt in (8, 12, 16, 32, 5):
        step_fn(bt)
    # n = ceil(B / 8) requests x ceil(B / n) tokens
    assert shapes == [(1, 8), (2, 6), (2, 8), (4, 8), (1, 5)]
    assert adapter.lengths.tolist() == [16] * 4  # nothing committed: every probe sees the same context
    with pytest.raises(ValueError, match="max-batch-tokens"):
        step_fn(33)


def test_profile_sps_cli_with_the_engine_factory_as_default(tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"), step_fn_factory=make_step_fn)
    out = tmp_path / "sps.json"
    args = parser.parse_args(["profile-sps", "--factory-arg", "target=tiny", "--factory-arg", "context=8",
                              "--batch-tokens", "8,16", "--warmup", "0", "--repeats", "1",
                              "--steps-per-repeat", "1", "--out", str(out)])
    assert args.func(args) == 0
    table = json.loads(out.read_text())
    assert table["sample_batch_tokens"] == [8, 16] and table["max_batch_tokens"] == 16
    assert all(s > 0 for s in table["sample_steps_per_sec"])
    # plain decode columns at the default request counts; no drafter on the tiny target, so no draft column
    assert table["plain_batch_sizes"] == [1, 2, 4, 8, 16, 32, 64] and "draft_seconds" not in table
    assert all(s > 0 for s in table["plain_steps_per_sec"])
    assert out.with_suffix(".png").is_file()


def test_profile_sps_calls_step_fn_per_probe():
    step_fn = make_step_fn(max_batch_tokens=16, target="tiny", dtype="fp32", context=4)
    table = profile_sps(step_fn=step_fn, batch_tokens=[16, 8], warmup=1, repeats=2, steps_per_repeat=1,
                        progress=False)
    assert table.sample_batch_tokens == [8, 16] and len(table.sample_steps_per_sec) == 2


def test_plain_fn_runs_one_uncommitted_token_per_request():
    step_fn = make_step_fn(max_batch_tokens=8, target="tiny", dtype="fp32", context=4, max_requests=3)
    adapter = step_fn.adapter
    shapes = []
    extend = adapter.extend
    adapter.extend = lambda tokens, **kw: shapes.append(tuple(tokens.shape)) or extend(tokens, **kw)
    for n in (1, 3, 2):
        step_fn.plain_fn(n)
    assert shapes == [(1, 1), (3, 1), (2, 1)]
    assert adapter.lengths.tolist() == [4] * 3
    assert not hasattr(step_fn, "draft_fn")  # drafter 'default' on the tiny target = none
    with pytest.raises(ValueError, match="max_requests"):
        step_fn.plain_fn(4)


def test_draft_fn_times_an_hspec_drafter(tmp_path):
    from sglang_hspec.assets.tiny import tiny_target
    from sglang_hspec.model import HSpecConfig, build_drafter
    from sglang_hspec.model.checkpoint import save_drafter
    from sglang_hspec.target.geometry import TargetGeometry

    target = tiny_target("llama")
    cfg = HSpecConfig(target=TargetGeometry.from_hf_config(target.config),
                      target_layer_ids=(0, 1, 1, 1, 1)[: min(5, target.config.num_hidden_layers)],
                      mask_token_id=0, intermediate_size=32, block_size=3, mamba_num_heads=2, mamba_head_dim=8,
                      mamba_groups=1, fusion_rank=8, markov_rank=4, sliding_window=16,
                      draft_vocab_size=target.config.vocab_size)
    save_drafter(build_drafter("hspec", cfg, target.model.embed_tokens, target.lm_head), tmp_path / "d")
    step_fn = make_step_fn(max_batch_tokens=8, target="tiny", dtype="fp32", context=4, max_requests=2,
                           drafter=str(tmp_path / "d"))
    table = profile_sps(step_fn=step_fn, batch_tokens=[1, 8], plain_fn=step_fn.plain_fn, draft_fn=step_fn.draft_fn,
                        plain_batch_sizes=[2, 1], warmup=0, repeats=1, steps_per_repeat=1, progress=False)
    assert table.plain_batch_sizes == [1, 2] and len(table.plain_steps_per_sec) == 2
    assert len(table.draft_seconds) == 2 and all(t > 0 for t in table.draft_seconds)


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_the_profiled_target_runs_the_row_invariant_mode_the_engine_loads(monkeypatch, mode):
    """The table times the forwards the engine runs: the factory loads the target with the engine's
    batch_invariant mode (default auto), passed through --factory-arg batch_invariant=..."""
    from sglang_hspec.target import loading

    seen = []
    real = loading.load_target
    monkeypatch.setattr(loading, "load_target", lambda *a, **kw: seen.append(kw["batch_invariant"]) or real(*a, **kw))
    kwargs = {} if mode == "auto" else {"batch_invariant": mode}
    make_step_fn(max_batch_tokens=8, tokens_per_request=8, target="tiny", dtype="fp32", context=16, max_requests=1,
                 drafter="none", **kwargs)
    assert seen == [mode]
