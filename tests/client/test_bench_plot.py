"""bench_serve.png: one colour per server in every panel, the tau panel included (its legend is panel 0's)."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt

from sglang_hspec.client import bench


def _row(server: str, c: int, tput: float, tau: float | None) -> dict:
    return {"server": server, "concurrency": c, "requests": 4, "errors": 0, "wall_s": 1.0, "output_tokens": 64,
            "throughput_tok_s": tput, "per_user_tok_s_p50": tput / c, "per_user_tok_s_p90": tput / c,
            "latency_s_p50": 1.0, "latency_s_p90": 1.0, "tau": tau, "verify_steps": 0 if tau is None else 10,
            "wasted_verify_tokens": 0, "wasted_verify_per_token": None}


ROWS = [_row(s, c, t, tau) for s, tau in (("none", None), ("HSPEC", 1.5), ("HSPEC+auto", 1.1))
        for c, t in ((1, 10.0), (4, 30.0))]


def test_each_server_keeps_its_colour_in_the_tau_panel():
    fig = bench.figure([bench.msgspec.convert(r, bench.LevelSummary) for r in ROWS])
    try:
        throughput, _, tau = fig.axes
        legend = {t.get_text(): h.get_color() for t, h in zip(throughput.get_legend().get_texts(),
                                                              throughput.get_legend().legend_handles)}
        assert list(legend) == ["none", "HSPEC", "HSPEC+auto"]
        tau_lines = {line.get_label(): line.get_color() for line in tau.get_lines()}
        assert list(tau_lines) == ["HSPEC", "HSPEC+auto"]  # no tau without speculation
        assert tau_lines == {"HSPEC": legend["HSPEC"], "HSPEC+auto": legend["HSPEC+auto"]}
        assert legend["HSPEC"] != legend["none"]
    finally:
        plt.close(fig)


def test_replot_redraws_beside_the_json(tmp_path):
    src = tmp_path / "bench_serve.json"
    src.write_text(json.dumps({"config": {}, "servers": {}, "results": ROWS}))
    assert bench.replot(src) == tmp_path / "bench_serve.png"
    assert (tmp_path / "bench_serve.png").read_bytes()[:4] == b"\x89PNG"
