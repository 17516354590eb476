"""The reference engine's profile-sps step function: the verify forwards it runs, and the CLI wiring."""

import argparse
import json

import pytest
import torch
from sglang_hspec.scheduler.profiler import add_parser, profile_sps

from sglang_hspec.engine.profile import make_step_fn


def test_step_fn_runs_uncommitted_verify_forwards_of_the_asked_size():
    step_fn = make_step_fn(max_batch_tokens=32, tokens_per_request=8, target="tiny", dtype="fp32", context=16)
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
    assert out.with_suffix(".png").is_file()


def test_profile_sps_calls_step_fn_per_probe():
    step_fn = make_step_fn(max_batch_tokens=16, target="tiny", dtype="fp32", context=4)
    table = profile_sps(step_fn=step_fn, batch_tokens=[16, 8], warmup=1, repeats=2, steps_per_repeat=1,
                        progress=False)
    assert table.sample_batch_tokens == [8, 16] and len(table.sample_steps_per_sec) == 2
