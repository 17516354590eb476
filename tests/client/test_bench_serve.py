"""The serving benchmark: aggregation by hand, the closed loop, and the CLI end to end on fake servers."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import types

import pytest
from fake_sglang import Behaviour, FakeSGLangServer

from sglang_hspec.client import bench
from sglang_hspec.client.bench import Conversation, RequestRecord


def test_summarize_by_hand() -> None:
    records = [
        RequestRecord(
            conversation_id="a",
            turn=0,
            completion_tokens=10,
            latency_s=1.0,
            verify_ct=4,
            wasted_verify_tokens=23,
        ),
        RequestRecord(
            conversation_id="a",
            turn=1,
            completion_tokens=20,
            latency_s=2.0,
            verify_ct=5,
            wasted_verify_tokens=10,
        ),
        RequestRecord(conversation_id="b", turn=0, completion_tokens=6, latency_s=0.5),  # no spec stats
        RequestRecord(conversation_id="c", turn=0, completion_tokens=0, latency_s=0.0, error="HTTP 500: x"),
    ]
    s = bench.summarize("hspec", 3, records, wall_s=2.0)
    assert (s.requests, s.errors, s.output_tokens, s.first_error) == (4, 1, 36, "HTTP 500: x")
    assert s.throughput_tok_s == 18.0
    # per-user speeds 10, 10, 12 -> p50 10, p90 = 10 + 0.8 * (12 - 10) (linear interpolation)
    assert s.per_user_tok_s_p50 == 10.0
    assert s.per_user_tok_s_p90 == pytest.approx(11.6)
    assert (s.latency_s_p50, s.latency_s_p90) == (1.0, pytest.approx(1.8))
    # tau over spec requests only: 30 tokens / 9 verify steps; wasted 33 over those 30 tokens.
    assert s.tau == pytest.approx(30 / 9)
    assert (s.verify_steps, s.wasted_verify_tokens, s.wasted_verify_per_token) == (9, 33, pytest.approx(1.1))


def test_summarize_without_spec_stats_reports_no_tau() -> None:
    records = [RequestRecord(conversation_id="a", turn=0, completion_tokens=8, latency_s=1.0)]
    s = bench.summarize("baseline", 1, records, wall_s=1.0)
    assert (s.tau, s.verify_steps, s.wasted_verify_per_token) == (None, 0, None)


def test_closed_loop_keeps_exactly_c_requests_in_flight() -> None:
    convs = [Conversation(id=str(i), turns=("Hello world",)) for i in range(2)]
    level = bench.conversations_for_level(convs, 3)
    assert [c.id for c in level] == ["0", "1", "0#1", "1#1", "0#2", "1#2"]
    with FakeSGLangServer(Behaviour(delay_s=0.3)) as server:
        records, wall = asyncio.run(
            bench.run_level(server.url, level, concurrency=3, max_tokens=10, ignore_eos=True)
        )
        assert server.behaviour.max_in_flight == 3
    assert len(records) == 6 and all(r.error is None and r.completion_tokens == 10 for r in records)


def test_multi_turn_conversations_carry_history(fake_server: FakeSGLangServer) -> None:
    conv = Conversation(id="mt", turns=("first question", "second question"))
    records, _ = asyncio.run(
        bench.run_level(fake_server.url, [conv], concurrency=1, max_tokens=5, ignore_eos=True)
    )
    assert [r.turn for r in records] == [0, 1]
    second = fake_server.behaviour.requests[-1][1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[2]["content"] == "second question" and second[1]["content"].startswith(" w")


def test_failed_turn_is_recorded_and_ends_its_conversation() -> None:
    conv = Conversation(id="x", turns=("a", "b"))
    with FakeSGLangServer(Behaviour(mode="http500")) as server:
        records, _ = asyncio.run(bench.run_level(server.url, [conv], concurrency=1))
    assert len(records) == 1 and "HTTP 500" in records[0].error


def _write_prompts(tmp_path, n: int = 4):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": f"q{i}", "turns": [f"question {i}", f"follow up {i}"]}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("api", ["chat", "generate"])
def test_cli_compare_end_to_end(tmp_path, capsys, api: str) -> None:
    prompts = _write_prompts(tmp_path)
    out = tmp_path / "out"
    with FakeSGLangServer(Behaviour()) as spec, FakeSGLangServer(Behaviour(speculative=False)) as base:
        rc = bench.main(
            [
                "--compare", f"HSPEC={spec.url}", f"baseline={base.url}",
                "--prompts", str(prompts), "--concurrency", "1,3", "--api", api,
                "--max-tokens", "10", "--ignore-eos", "--out", str(out),
            ]
        )  # fmt: skip
    assert rc == 0
    report = json.loads((out / "bench_serve.json").read_text())
    assert report["config"]["baseline"] == "baseline"
    assert report["servers"]["HSPEC"]["speculative_algorithm"] == "HSPEC"
    assert report["servers"]["baseline"]["speculative_algorithm"] is None
    rows = {(r["server"], r["concurrency"]): r for r in report["results"]}
    assert sorted(rows) == [("HSPEC", 1), ("HSPEC", 3), ("baseline", 1), ("baseline", 3)]
    # 4 conversations at c=1; max(4, 2*3) = 6 at c=3; 2 turns each; 10 tokens per request.
    for (server, conc), row in rows.items():
        n_req = 2 * (4 if conc == 1 else 6)
        assert (row["requests"], row["errors"], row["output_tokens"]) == (n_req, 0, 10 * n_req)
        if server == "HSPEC":
            # Every request: 10 tokens, 4 verify steps, 23 wasted (see test_client_sdk).
            assert (row["tau"], row["verify_steps"], row["wasted_verify_tokens"]) == (
                2.5,
                4 * n_req,
                23 * n_req,
            )
        else:
            assert (row["tau"], row["verify_steps"]) == (None, 0)
    assert (out / "bench_serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "tau" in table and "vs base" in table
    hspec_c1 = next(
        line for line in table.splitlines() if line.startswith("HSPEC") and line.split()[1] == "1"
    )
    assert hspec_c1.split()[8] == "2.50"  # tau column
    assert hspec_c1.split()[9] == "2.30"  # wasted verify tokens per output token: 23 / 10


def test_rounds_drive_every_server_in_turn_and_pool_their_tokens(tmp_path, capsys, monkeypatch) -> None:
    """--rounds 2: per level, round 1 runs A then B, round 2 B then A (order-balanced); a row pools its rounds
    (tokens / summed wall) and the table shows the range of the per-round ratios to the baseline."""
    calls: list[tuple[str, int]] = []
    walls = iter([1.0, 2.0, 2.0, 2.0, 4.0, 1.0, 1.0, 1.0])  # A, B, B, A at c=1; then at c=2

    async def fake_level(url, conversations, *, concurrency, max_tokens, on_request=None, **_):
        calls.append((url, concurrency))
        recs = [
            RequestRecord(conversation_id=c.id, turn=t, completion_tokens=max_tokens, latency_s=0.1)
            for c in conversations
            for t in range(len(c.turns))
        ]
        return recs, next(walls)

    monkeypatch.setattr(bench, "run_level", fake_level)

    async def fake_info(url):
        return {"speculative_algorithm": None}

    monkeypatch.setattr(bench, "_server_info", fake_info)
    prompts = _write_prompts(tmp_path, 2)  # 2 conversations x 2 turns: 4 requests per round at c=1 and c=2
    out = tmp_path / "out"
    argv = ["--compare", "A=http://a:1", "B=http://b:1", "--baseline", "B", "--prompts", str(prompts)]
    argv += ["--concurrency", "1,2", "--max-tokens", "10", "--rounds", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    a1, b1, a2, b2 = ("http://a:1", 1), ("http://b:1", 1), ("http://a:1", 2), ("http://b:1", 2)
    assert calls == [a1, b1, b1, a1, a2, b2, b2, a2]
    rows = {
        (r["server"], r["concurrency"]): r
        for r in json.loads((out / "bench_serve.json").read_text())["results"]
    }
    # c=1: A 40 tok in 1 s and 2 s -> rounds 40, 20 tok/s, pooled 80 / 3; B 40 tok in 2 s twice -> 20, 20
    assert rows["A", 1]["round_throughputs"] == [40.0, 20.0] and rows["A", 1]["requests"] == 8
    assert rows["A", 1]["throughput_tok_s"] == pytest.approx(80 / 3)
    assert rows["B", 1]["throughput_tok_s"] == 20.0
    assert rows["A", 2]["round_throughputs"] == [20.0, 80.0]  # c=2: 4 conversations, 80 tokens per round
    table = capsys.readouterr().out
    line = {(ln.split()[0], ln.split()[1]): ln.split() for ln in table.splitlines() if ln[:1] in "AB"}
    assert line["A", "1"][5] == "1.33x" and line["A", "1"][10] == "1.00-2.00x"  # 40/20 and 20/20
    assert line["A", "2"][10] == "0.25-1.00x"  # 20/80 and 80/80
    assert line["B", "2"][10] == "1.00-1.00x"


def test_bad_rounds_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--url", "http://a:1", "--prompts", "x.jsonl", "--rounds", "0"])
    assert "--rounds wants a positive integer, got '0'" in capsys.readouterr().err


def test_cli_stops_with_a_clear_message_when_a_server_is_down(tmp_path) -> None:
    prompts = _write_prompts(tmp_path, 1)
    with FakeSGLangServer(listen=False) as down:
        with pytest.raises(SystemExit, match="cannot connect"):
            bench.main(
                ["--url", down.url, "--prompts", str(prompts), "--concurrency", "1", "--out", str(tmp_path)]
            )


def test_cli_stops_when_every_request_fails(tmp_path) -> None:
    prompts = _write_prompts(tmp_path, 1)
    with FakeSGLangServer(Behaviour(mode="http500")) as server:
        with pytest.raises(SystemExit, match="every request failed: .*HTTP 500"):
            bench.main(
                ["--url", server.url, "--prompts", str(prompts), "--concurrency", "1", "--out", str(tmp_path)]
            )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompts", "x.jsonl"], "exactly one of --url"),
        (["--url", "http://a", "--compare", "A=http://b", "--prompts", "x.jsonl"], "exactly one of --url"),
        (["--compare", "A:http://b", "--prompts", "x.jsonl"], "NAME=http"),
        (["--compare", "A=http://b", "A=http://c", "--prompts", "x.jsonl"], "distinct"),
        (["--compare", "A=http://b", "B=http://c", "--baseline", "C", "--prompts", "x.jsonl"], "--baseline"),
        (["--url", "http://a", "--prompts", "missing.jsonl"], "no such file"),
        (["--url", "http://a:99999", "--prompts", "x.jsonl"], r"^--url: base_url 'http://a:99999': port"),
        (["--compare", "A=http://b:0", "B=http://c", "--prompts", "x"], r"^--compare A=: .* port 0 is"),
    ],
)
def test_cli_argument_errors(argv, message) -> None:
    with pytest.raises(SystemExit, match=message):
        bench.main(argv)


def test_bad_concurrency_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--url", "http://a", "--prompts", "x", "--concurrency", "1,zero"])
    assert "--concurrency wants integers" in capsys.readouterr().err


def test_prompt_file_errors_name_the_line(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "turns": ["ok"]}\n{"id": 2, "turns": []}\n')
    with pytest.raises(SystemExit, match=r"line 2: expected"):
        bench.load_conversations(str(path))
    path.write_text('{"id": 1, "turns": "single turn"}\n\n{"turns": ["a", "b"]}\n')
    assert bench.load_conversations(str(path)) == [
        Conversation(id="1", turns=("single turn",)),
        Conversation(id="3", turns=("a", "b")),
    ]
    assert len(bench.load_conversations(str(path), limit=1)) == 1


def test_named_prompt_sets_come_from_the_assets_module(monkeypatch) -> None:
    calls = []

    def load_prompts(name, *, limit=None):
        calls.append((name, limit))
        return [
            types.SimpleNamespace(id="m1", turns=["t1", "t2"]),
            types.SimpleNamespace(id="m2", turns=["u"]),
        ]

    monkeypatch.setitem(
        sys.modules, "sglang_hspec.assets.prompts", types.SimpleNamespace(load_prompts=load_prompts)
    )
    convs = bench.load_conversations("mtbench", limit=2)
    assert calls == [("mtbench", 2)]
    assert convs == [Conversation(id="m1", turns=("t1", "t2")), Conversation(id="m2", turns=("u",))]

    monkeypatch.setitem(sys.modules, "sglang_hspec.assets.prompts", None)  # import fails
    with pytest.raises(SystemExit, match="JSONL file"):
        bench.load_conversations("mtbench")


def test_add_parser_wires_a_bench_serve_subcommand() -> None:
    root = argparse.ArgumentParser(prog="hspec")
    bench_group = root.add_subparsers(dest="cmd").add_parser("bench").add_subparsers(dest="bench_cmd")
    bench.add_parser(bench_group)
    args = root.parse_args(
        ["bench", "serve", "--url", "http://h:1", "--prompts", "mtbench", "--concurrency", "2,8"]
    )
    assert args.func is bench.run_serve
    assert (args.url, args.concurrency, args.api, args.max_tokens) == ("http://h:1", [2, 8], "chat", 256)
