"""The SPS profiling client, without a server: the profiling server's command line, the default probe grid,
the capacity, and the `hspec profile-sps` wiring. Pure (no SGLang); the real profile is in
test_sglang_sps_profile.py."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from sglang_hspec import cli
from sglang_hspec.sglang_plugin.sps_profile import capacity_batch_tokens, default_batch_sizes, relaunch_argv

SERVER_FLAGS = ["--model-path", "/m", "--speculative-algorithm", "HSPEC", "--tp-size", "2"]


def test_relaunch_argv_from_launch_server_drops_host_port_table_and_keys():
    argv = ["/venv/lib/python3.11/site-packages/sglang/launch_server.py", *SERVER_FLAGS, "--port", "30000",
            "--host=0.0.0.0", "--speculative-dspark-sps-table-path", "old.json", "--api-key", "secret",
            "--dtype", "bfloat16"]
    assert relaunch_argv(argv, port=4321) == [
        sys.executable, "-m", "sglang.launch_server", *SERVER_FLAGS, "--dtype", "bfloat16",
        "--skip-server-warmup", "--host", "127.0.0.1", "--port", "4321"]


def test_relaunch_argv_from_sglang_serve_keeps_its_warmup_flag():
    argv = ["/venv/bin/sglang", "serve", *SERVER_FLAGS, "--skip-server-warmup", "--port=8000"]
    assert relaunch_argv(argv, port=1) == [sys.executable, "/venv/bin/sglang", "serve", *SERVER_FLAGS,
                                           "--skip-server-warmup", "--host", "127.0.0.1", "--port", "1"]


def test_relaunch_argv_refuses_an_in_process_engine():
    with pytest.raises(RuntimeError, match="hspec profile-sps --url"):
        relaunch_argv(["my_app.py", "--model-path", "/m"], port=1)


def _info(*, max_running=48, graph_bs=(1, 2, 4, 8, 16, 24, 32), disable_cuda_graph=False, draft_tokens=8):
    return {"disable_cuda_graph": disable_cuda_graph, "speculative_num_draft_tokens": draft_tokens,
            "internal_states": [{"effective_max_running_requests_per_dp": max_running,
                                 "cuda_graph_config": {"decode": {"bs": list(graph_bs)}}}]}


def test_default_grid_stops_at_the_running_cap_and_the_largest_cuda_graph():
    assert default_batch_sizes(_info()) == [1, 2, 4, 8, 16, 32]  # graphs end at 32 < 48 running
    assert default_batch_sizes(_info(graph_bs=range(1, 257))) == [1, 2, 4, 8, 16, 32, 48]
    assert default_batch_sizes(_info(disable_cuda_graph=True)) == [1, 2, 4, 8, 16, 32, 48]  # CPU: no graphs
    assert default_batch_sizes(_info(max_running=3)) == [1, 2, 3]
    with pytest.raises(ValueError, match="--batch-size"):
        default_batch_sizes({"internal_states": [{}]})


def test_capacity_is_running_cap_times_verify_tokens():
    assert capacity_batch_tokens(_info()) == 48 * 8
    assert capacity_batch_tokens({"internal_states": [{}]}) is None


def test_url_and_engine_options_do_not_mix(tmp_path, capsys):
    rc = cli.main(["profile-sps", "--url", "http://127.0.0.1:1", "--step-fn", "m:f", "--out", str(tmp_path / "t")])
    assert rc == 2 and "--batch-size" in capsys.readouterr().err


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    rc = cli.main(["profile-sps", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "sps.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot reach the SGLang server at http://127.0.0.1:9" in err
    assert not (tmp_path / "sps.json").exists()


def test_without_url_the_reference_engine_keeps_its_defaults(tmp_path):
    out = tmp_path / "sps.json"  # --repeats omitted: the engine's default 5 (with --url: one sweep)
    rc = cli.main(["profile-sps", "--factory-arg", "target=tiny", "--factory-arg", "context=8", "--batch-tokens", "8",
                   "--warmup", "0", "--steps-per-repeat", "1", "--out", str(out)])
    assert rc == 0
    assert json.loads(out.read_text())["sample_batch_tokens"] == [8]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="checks an environment without SGLang")
def test_profiling_without_sglang_says_how_to_install_it(tmp_path, capsys):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps(_info()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc = cli.main(["profile-sps", "--url", f"http://127.0.0.1:{server.server_port}", "--out",
                       str(tmp_path / "sps.json")])
    finally:
        server.shutdown()
    assert rc == 2 and "pip install 'sglang-hspec[sglang]'" in capsys.readouterr().err


def test_auto_profile_writes_the_table_and_its_greedy_twin_with_plain_probes(tmp_path, monkeypatch):
    """`profile_with_server(plain_probes=True, greedy_probes=True)` with the servers faked: the drafting
    server is profiled at the settings' temperature into the table and at temperature 0 into its twin, the
    never-drafting one anchor-only; both tables carry the plain probes; nothing temporary is left."""
    from sglang_hspec.scheduler.sps import SpsCostTable, load_sps_table, save_sps_table

    from sglang_hspec.sglang_plugin import sps_profile

    servers = []

    def fake_profile_once(*, cmd, port, outs, log_path, env, startup_timeout):
        servers.append((env["HSPEC_SPECULATION"], [settings for _, settings in outs]))
        for out, settings in outs:
            if settings.get("anchor_only"):  # plain steps, one token per request
                table = SpsCostTable(sample_batch_tokens=[1, 2], sample_steps_per_sec=[12.0, 10.0], max_batch_tokens=16)
            else:  # greedy steps cheaper than sampled ones
                rate = 6.0 if settings.get("temperature", 1.0) == 0.0 else 5.0
                table = SpsCostTable(sample_batch_tokens=[8, 16], sample_steps_per_sec=[rate, rate - 1],
                                     max_batch_tokens=16)
            save_sps_table(table, out)
        return 8

    monkeypatch.setattr(sps_profile, "_profile_once", fake_profile_once)
    out = tmp_path / "sps" / "server.json"
    argv = ["launch_server.py", "--model-path", "/m"]
    sps_profile.profile_with_server(out=out, settings={"min_steady_steps": 16}, argv=argv, plain_probes=True,
                                    greedy_probes=True)
    assert servers == [("always", [{"min_steady_steps": 16}, {"min_steady_steps": 16, "temperature": 0.0, "plot": False}]),
                       ("never", [{"min_steady_steps": 16, "plot": False, "anchor_only": True}])]
    sampled, greedy = load_sps_table(out), load_sps_table(tmp_path / "sps" / "server.greedy.json")
    assert sps_profile.greedy_table_path(out) == tmp_path / "sps" / "server.greedy.json"
    assert sampled.sample_steps_per_sec == [5.0, 4.0] and greedy.sample_steps_per_sec == [6.0, 5.0]
    for table in (sampled, greedy):
        assert table.plain_batch_sizes == [1, 2] and table.plain_steps_per_sec == [12.0, 10.0]
    assert sorted(p.name for p in out.parent.iterdir()) == ["server.greedy.json", "server.json"]
