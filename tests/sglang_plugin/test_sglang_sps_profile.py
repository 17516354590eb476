"""SPS tables for HSPEC servers, end to end on CPU (tiny Qwen3 target, tiny H-Spec drafter, block 3 so 4
verify tokens per request): `hspec profile-sps --url` measures a running HSPEC server with SGLang's own
profiler and writes a table the server then serves with; the opt-in auto-profile measures once, caches
the table and reuses it; without a table the server says that it verifies full blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.sglang]

HSPEC_PLUGINS = ("sglang_cpu_testing", "hspec")
VERIFY_TOKENS = 4  # the drafter's block 3 + the anchor
GRID = "1,2"  # running-request counts: probes at 4 and 8 batch tokens
QUICK = ["--min-steady-steps", "4", "--min-steady-seconds", "0"]


@pytest.fixture(scope="module")
def hspec_draft(tiny_checkpoints, tmp_path_factory):
    from sglang_cpu import builders

    return builders.build_hspec_draft(tmp_path_factory.mktemp("sps_draft") / "hspec", tiny_checkpoints["target"])


def _hspec_args(draft, *extra):
    return ["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(draft), *extra]


def _check_table(path: Path):
    from sglang_hspec.scheduler import load_sps_table

    table = load_sps_table(path)  # our strict loader: SGLang's exact layout
    assert table.sample_batch_tokens == [1 * VERIFY_TOKENS, 2 * VERIFY_TOKENS]
    assert all(s > 0 for s in table.sample_steps_per_sec)
    assert table.max_batch_tokens == 48 * VERIFY_TOKENS  # HSPEC's 48 running requests x 4 verify tokens
    return table


@pytest.mark.slow
def test_profile_sps_url_writes_a_table_the_server_accepts(tiny_checkpoints, hspec_draft, sglang_server, tmp_path):
    from sglang_cpu import builders
    from sglang_cpu.server import sglang_python

    from sglang_hspec.sglang_plugin.sps_profile import PROFILING_SERVER_ENVIRONMENT

    target = tiny_checkpoints["target"]
    srv = sglang_server(target, name="hspec_profiled", plugins=HSPEC_PLUGINS, args=_hspec_args(hspec_draft),
                        env_extra=PROFILING_SERVER_ENVIRONMENT)
    # no table, no auto-profile: the launcher says so (static: every request verifies its full block)
    assert ("SGLANG_RAGGED_VERIFY_MODE=static: every request verifies its full block of 3 draft tokens "
            "(fixed k)") in srv.log()

    out = tmp_path / "sps" / "hspec.json"
    t0 = time.monotonic()
    run = subprocess.run(
        [sglang_python(), "-m", "sglang_hspec.cli", "profile-sps", "--url", srv.url, "--batch-size", GRID, *QUICK,
         "--out", str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(f"profile-sps --url: {time.monotonic() - t0:.0f} s")
    _check_table(out)
    rounds = [json.loads(line) for line in out.with_name("hspec.rounds.jsonl").read_text().splitlines()]
    assert [r["batch_size"] for r in rounds] == [1, 2]
    assert all(r["num_steady_steps"] >= 4 and r["match_fraction"] == 1.0 for r in rounds)
    assert json.loads(out.with_name("hspec.json.manifest.json").read_text())["verify_num_draft_tokens"] == 4
    assert out.with_suffix(".png").is_file()
    srv.stop()

    served = sglang_server(target, name="hspec_with_table", plugins=HSPEC_PLUGINS,
                           args=_hspec_args(hspec_draft, "--speculative-dspark-sps-table-path", str(out)),
                           env_extra={"SGLANG_RAGGED_VERIFY_MODE": "compact"})
    log = served.log()
    assert f"HSPEC: SPS table {out} (--speculative-dspark-sps-table-path)" in log
    assert f"mode=compact, lag=2, relay_lag=2, sps_table={out}" in log  # SGLang's planner loaded it
    assert "verifies its full block" not in log
    prompts = builders.PROMPTS[:2]
    assert [o["output_ids"] for o in served.generate(prompts, 16)] == builders.hf_greedy(target, prompts, 16)


@pytest.mark.slow
def test_auto_profile_caches_the_table_and_reuses_it(tiny_checkpoints, hspec_draft, tmp_path):
    from sglang_cpu import server as cpu_server

    from sglang_hspec.sglang_plugin.sps_cache import SpsCacheKey, key_sidecar, table_path_for
    from sglang_hspec.sglang_plugin.sps_profile import greedy_table_path

    target = tiny_checkpoints["target"]
    cache = tmp_path / "cache"
    # HSPEC_SPECULATION=auto: the auto-profile also measures plain decode steps on a second profiling server
    # that never drafts (it verifies one token per request, which SGLang's profiler must be told)
    env = {"SGLANG_RAGGED_VERIFY_MODE": "compact", "HSPEC_AUTO_PROFILE_SPS": "1", "HSPEC_CACHE_DIR": str(cache),
           "HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES": GRID, "HSPEC_AUTO_PROFILE_SPS_STEADY_STEPS": "4",
           "HSPEC_AUTO_PROFILE_SPS_STEADY_SECONDS": "0", "HSPEC_SPECULATION": "auto"}
    key = SpsCacheKey.from_server_args(SimpleNamespace(
        model_path=str(target), speculative_draft_model_path=str(hspec_draft), tp_size=1, dtype="float32",
        device="cpu"))
    path = table_path_for(key, cache / "sps")

    def start(name):
        srv = cpu_server.launch(target, log_path=tmp_path / f"{name}.log", args=_hspec_args(hspec_draft),
                                plugins=HSPEC_PLUGINS, env_extra=env, timeout=900)
        print(f"{name}: ready in {time.monotonic() - srv.started_s:.0f} s")
        try:
            assert len(srv.generate(["Hello"], 4)[0]["output_ids"]) == 4
        finally:
            srv.stop()
        return srv.log()

    first = start("auto_first")
    assert "no cached SPS table" in first and f"profiled SPS table cached at {path}" in first
    assert f"sps_table={path}" in first  # the planner of this very start uses it
    table = _check_table(path)
    assert table.plain_batch_sizes == [1, 2] and all(s > 0 for s in table.plain_steps_per_sec)
    # ... and the drafting server at temperature 0 (argmax drafts) into the greedy twin, same plain probes
    twin = _check_table(greedy_table_path(path))
    assert twin.plain_steps_per_sec == table.plain_steps_per_sec
    assert twin.sample_batch_tokens == table.sample_batch_tokens and all(s > 0 for s in twin.sample_steps_per_sec)
    assert f"HSPEC: all-greedy steps are costed by the greedy SPS twin {greedy_table_path(path)}" in first
    assert "HSPEC: speculation policy auto (HSPEC_SPECULATION)" in first
    assert json.loads(key_sidecar(path).read_text())["model"] == str(Path(target).resolve())
    assert "verifies its full block" not in path.with_name(path.stem + ".server.log").read_text()
    stamp = os.stat(path).st_mtime_ns

    second = start("auto_second")
    assert f"HSPEC: reusing cached SPS table {path}" in second and "no cached SPS table" not in second
    assert f"sps_table={path}" in second
    assert os.stat(path).st_mtime_ns == stamp  # not profiled again
    assert sorted(p.name for p in path.parent.glob("*.json") if not p.name.endswith((".key.json", ".manifest.json"))) \
        == sorted([path.name, greedy_table_path(path).name])


@pytest.mark.slow
def test_hooks_make_sglang_profiler_accept_hspec(monkeypatch):
    """Inside SGLang's real profiler: `fetch_server_context` refuses an HSPEC CPU server as shipped and
    accepts it with the hooks, reading the same records payload."""
    from sglang_hspec.sglang_plugin import sps_hooks

    prof = sps_hooks.apply()
    info = {"speculative_algorithm": "HSPEC", "device": "cpu", "disable_cuda_graph": True, "tp_size": 1,
            "tokenizer_path": "/tok",
            "internal_states": [{"dp_size": 1, "effective_max_running_requests_per_dp": 48,
                                 "cuda_graph_config": {"decode": {"bs": [1, 2, 4]}},
                                 "dspark_info_record": {"mode": "static", "components": ["core", "step_cpu_time"],
                                                        "simulate_acc_len": 1.0, "verify_num_draft_tokens": 4,
                                                        "records": []}}]}

    class Response:
        def raise_for_status(self):
            pass

        def json(self):
            return json.loads(json.dumps(info))

    monkeypatch.setattr(prof, "requests", SimpleNamespace(get=lambda url, timeout: Response()))
    with pytest.raises(ValueError, match="Profile against a DSpark server"):
        prof.fetch_server_context.__wrapped__(base_url="http://x", local_tokenizer_path=None)
    context = prof.fetch_server_context(base_url="http://x", local_tokenizer_path=None)
    # On CPU the sweep is bounded by the running cap (48), not the reported capture list [1, 2, 4].
    assert (context.verify_num_draft_tokens, context.cuda_graph_max_bs, context.tokenizer_path) == (4, 48, "/tok")
    assert isinstance(prof.requests, SimpleNamespace)  # the module's `requests` is restored after the call
    assert sys.modules[sps_hooks.PROFILER_MODULE] is prof
    # a never-drafting server (the plain-decode probes) is judged as verifying 1 token per request
    assert sps_hooks.RECORD_PAYLOAD_KEY == prof.INFO_RECORD_PAYLOAD_KEY
    with sps_hooks.anchor_only_profile():
        assert prof.fetch_server_context(base_url="http://x", local_tokenizer_path=None).verify_num_draft_tokens == 1


def _record_steps(dumper, clock, gaps_s):
    """Feed SGLang's step recorder decode steps `gaps_s` seconds apart; returns each record's step_cpu_ms."""
    import torch
    from sglang.srt.speculative.dspark_components.dspark_observability import DecodeStepObservation

    empty = torch.zeros(0, dtype=torch.int64)
    for ct, gap in enumerate(gaps_s):
        clock.now += gap
        dumper.observe_decode_step(DecodeStepObservation(
            forward_ct=ct, bs=1, mode="static", budget=None, lag_steps=None, num_verify_tokens=4,
            verify_tokens_local=4, verify_tokens_dp_synced=4, verify_tokens_graph_key=4, predicted_step_ms=None,
            predicted_theta=None, verify_lens=None, confidence=None, req_pool_indices=empty, prefix_lens=empty,
            draft_tokens=empty, bonus_tokens=empty, correct_len=empty, cap_trim_lens=empty, commit_lens=empty,
            rids=None))
    return [r.get("step_cpu_ms") for r in dumper.dump()["records"]]


def test_cpu_worker_keeps_slow_step_times_for_the_profiler():
    """SGLang's recorder drops steps over 1 s as idle gaps; on CPU a verify of 48 requests takes longer, which
    left the profiler with no records (auto-profile failed on the embedded server). The worker raises the
    cap on CPU only; a prefill still resets the clock, so idle gaps stay out."""
    import torch
    from sglang.srt.speculative.dspark_components.dspark_observability import DsparkInfoDumper

    from sglang_hspec.sglang_plugin.worker import allow_slow_cpu_steps

    def dumper_and_clock():
        clock = SimpleNamespace(now=100.0)
        dumper = DsparkInfoDumper(components={"core", "step_cpu_time"}, gamma=3, verify_num_draft_tokens=4,
                                  attn_tp_rank=0, device=torch.device("cpu"), mode_value="static",
                                  clock=lambda: clock.now)
        return SimpleNamespace(_info_dumper=dumper), clock

    shipped, clock = dumper_and_clock()
    assert _record_steps(shipped._info_dumper, clock, [0.0, 0.5, 2.5]) == [None, 500.0, None]

    ours, clock = dumper_and_clock()
    allow_slow_cpu_steps(ours, "cpu")
    assert _record_steps(ours._info_dumper, clock, [0.0, 0.5, 2.5, 299.0, 301.0]) == [None, 500.0, 2500.0,
                                                                                        299000.0, None]
    ours._info_dumper.note_non_decode_step()  # a prefill: the gap before the next decode step is not a step
    assert _record_steps(ours._info_dumper, clock, [50.0])[-1] is None

    on_gpu, clock = dumper_and_clock()
    allow_slow_cpu_steps(on_gpu, "cuda:0")
    assert _record_steps(on_gpu._info_dumper, clock, [0.0, 2.5]) == [None, None]
    allow_slow_cpu_steps(None, "cpu")  # a worker without observers (not the last pipeline rank)
