import json

import pytest
from sglang_hspec.scheduler.profiler import main, profile_sps
from sglang_hspec.scheduler.sps import load_sps_table


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_profile_sps_medians_repeats_and_skips_warmup():
    clock = FakeClock()
    calls = []
    # step time 1 ms + 10 us/token, every 7th call is a 10x outlier (the median drops it)
    def step_fn(bt):
        calls.append(bt)
        clock.now += (0.001 + 1e-5 * bt) * (10 if len(calls) % 7 == 0 else 1)

    table = profile_sps(step_fn=step_fn, batch_tokens=[100, 10], warmup=2, repeats=5, steps_per_repeat=1,
                        clock=clock, progress=False, max_batch_tokens=256)
    assert table.sample_batch_tokens == [10, 100] and table.max_batch_tokens == 256
    assert table.sample_steps_per_sec == pytest.approx([1 / 0.0011, 1 / 0.002])
    assert calls == [10] * 7 + [100] * 7


def test_profile_sps_rejects_bad_probes():
    with pytest.raises(ValueError, match="duplicates"):
        profile_sps(step_fn=lambda b: None, batch_tokens=[8, 8], progress=False)
    with pytest.raises(ValueError, match="empty"):
        profile_sps(step_fn=lambda b: None, batch_tokens=[], progress=False)
    with pytest.raises(ValueError, match="no measurable time"):
        profile_sps(step_fn=lambda b: None, batch_tokens=[8], clock=lambda: 0.0, progress=False)


def test_cli_on_tiny_target_writes_table_and_png(tmp_path):
    out = tmp_path / "sps.json"
    rc = main(["--step-fn", "sglang_hspec.engine.profile:make_step_fn", "--batch-tokens", "8,32",
               "--warmup", "1", "--factory-arg", "target=tiny", "--factory-arg", "context=16", "--repeats", "2", "--steps-per-repeat", "1", "--out", str(out)])
    assert rc == 0
    table = load_sps_table(out)
    # SGLang's three fields, plus the plain-decode columns (the tiny target has no drafter: no draft column)
    assert set(json.loads(out.read_text())) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens",
                                                "plain_batch_sizes", "plain_steps_per_sec"}
    assert table.plain_batch_sizes == [1, 2, 4, 8, 16, 32, 64] and all(s > 0 for s in table.plain_steps_per_sec)
    assert table.sample_batch_tokens == [8, 32] and all(s > 0 for s in table.sample_steps_per_sec)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flag, value", [
    ("--warmup", "-1"), ("--repeats", "0"), ("--steps-per-repeat", "0"), ("--tokens-per-request", "0"),
    ("--max-batch-tokens", "-1"), ("--batch-tokens", ","), ("--batch-tokens", "0,1"), ("--plain-batch-sizes", "0"),
    ("--repeats", "abc"),
])
def test_cli_numbers_out_of_range_fail_as_they_are_parsed(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["--step-fn", "unused:factory", "--out", str(tmp_path / "sps.json"), flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected" in capsys.readouterr().err
    assert not (tmp_path / "sps.json").exists()


def test_range_types_refuse_nan_and_inf():
    import argparse

    from sglang_hspec.scheduler.profiler import finite_at_least, int_at_least

    seconds = finite_at_least(0, "seconds")
    timeout = finite_at_least(0, "seconds", above=True)
    probability = finite_at_least(0, "a probability", at_most=1)
    assert seconds("0") == 0.0 and timeout("0.5") == 0.5 and probability("1") == 1.0 and int_at_least(0, "n")("0") == 0
    for parse, text in ((seconds, "nan"), (seconds, "inf"), (seconds, "-1"), (timeout, "0"), (probability, "1.5"),
                        (probability, "nan"), (int_at_least(1, "n"), "0"), (int_at_least(1, "n"), "1.5")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
