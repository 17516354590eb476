"""HSPEC served by the real SGLang on CPU under serving conditions: overlap scheduling on and off,
staggered concurrent requests, aborted requests. Tiny Qwen3 target, float32, greedy; the H-Spec drafter's
Markov head proposes the target's greedy bigrams (tests/sglang_cpu/builders.py), so drafts of several
tokens are really accepted and rejected. Speculation, batching, overlap and aborts must not change a token.

One server runs at a time (2-core CI machine): `ServerPool` keeps one per configuration and stops the
other when a test asks for it; tests run in file order, so the overlap server (SGLang's default) starts
once for the concurrency and abort tests, then the non-overlap one for the comparison at the end.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request
import uuid

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PLUGINS = ("sglang_cpu_testing", "hspec")
EXTRA_PROMPTS = [
    "def __repr__(self):\n        return",
    "try:\n    import",
    "if __name__ == '__main__':",
    "with open(path) as f:",
    "raise ValueError(",
    "    def close(self):",
    "x = [i * 2 for i in",
    "\"\"\"Return the",
    "from collections import",
    "while True:\n",
]


def _prompts():
    from sglang_cpu import builders

    return [*builders.PROMPTS, *EXTRA_PROMPTS]  # the first six are the ones the bigram drafter was fitted on


def _lengths(n: int) -> list[int]:
    return [8 + (13 * i) % 57 for i in range(n)]  # 8..64 new tokens, all different for 16 requests


class ServerPool:
    """At most one running server; each configuration is started once and reused until another one is
    asked for."""

    def __init__(self, target, drafter, log_dir):
        self.target, self.drafter, self.log_dir = target, drafter, log_dir
        self.name, self.server = None, None

    def get(self, name: str):
        from sglang_cpu import server as cpu_server

        if self.name == name and self.server.proc.poll() is None:
            return self.server
        self.close()
        args = ["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(self.drafter)]
        if name == "no_overlap":
            args.append("--disable-overlap-schedule")
        self.server = cpu_server.launch(self.target, log_path=self.log_dir / f"{name}.log", args=args,
                                        plugins=PLUGINS)
        self.name = name
        print(f"\n{name} server ready in {self.server.ready_s:.0f} s")
        return self.server

    def close(self):
        if self.server is not None:
            self.server.stop()
        self.name, self.server = None, None


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from sglang_cpu import builders

    root = tmp_path_factory.mktemp("sglang_serving")
    target = builders.build_tiny_target(root / "target")
    drafter = builders.build_hspec_draft(root / "hspec_bigram", target, bigram=True)
    pool = ServerPool(target, drafter, root)
    yield pool
    pool.close()


# ---- client helpers ----

def _get(srv, path: str):
    with urllib.request.urlopen(srv.url + path, timeout=60) as r:
        return json.loads(r.read())


def _generate(srv, prompt: str, max_new_tokens: int, **extra) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    return srv.post("/generate", {"text": prompt, "sampling_params": params, **extra})


def _one_by_one(srv, prompts, lengths) -> list[dict]:
    return [_generate(srv, p, n) for p, n in zip(prompts, lengths)]


def _staggered(srv, prompts, lengths, gap_s: float = 0.04) -> tuple[list[dict], int]:
    """One thread per request, each started `gap_s` after the previous: requests join a running batch
    at different decode steps. Returns the outputs and the largest number of requests seen running."""
    outs: list = [None] * len(prompts)
    errors: list = []

    def run(i):
        try:
            outs[i] = _generate(srv, prompts[i], lengths[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    peak = 0
    for t in threads:
        t.start()
        time.sleep(gap_s)
    while any(t.is_alive() for t in threads):
        peak = max(peak, _running(srv))
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert not errors, errors
    return outs, peak


def _running(srv) -> int:
    return sum(load["num_running_reqs"] for load in _get(srv, "/v1/loads")["loads"])


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _tracebacks_since(srv, offset: int) -> list[str]:
    new = srv.log()[offset:]
    return [new[max(0, i - 300): i + 1500] for i in range(len(new)) if new.startswith("Traceback", i)]


# ---- module-wide reference: every request sent one by one to the overlap server ----

@pytest.fixture(scope="module")
def reference(pool):
    srv = pool.get("overlap")
    prompts = _prompts()
    lengths = _lengths(len(prompts))
    outs = _one_by_one(srv, prompts, lengths)
    assert [len(o["output_ids"]) for o in outs] == lengths
    return {"prompts": prompts, "lengths": lengths, "ids": _ids(outs),
            "accept": [o["meta_info"]["spec_accept_length"] for o in outs]}


def _assert_speculated(accept: list[float]) -> None:
    """Block 3: at most 4 tokens per verify step. The bigram drafter was fitted on the first six prompts'
    greedy continuations (64 tokens), so there it must be accepted for several tokens per step."""
    assert all(a is not None and 1.0 <= a <= 4.0 for a in accept), accept
    fitted = accept[:6]
    assert min(fitted) > 1.0 and sum(fitted) / len(fitted) >= 2.0, fitted


def test_reference_matches_hf_and_speculates(pool, reference):
    """The one-by-one outputs the other tests compare against are the target's greedy continuation
    (HF transformers, float32), with real multi-token acceptance."""
    from sglang_cpu import builders

    golden = builders.hf_greedy(pool.target, reference["prompts"], max(reference["lengths"]))
    assert reference["ids"] == [g[:n] for g, n in zip(golden, reference["lengths"])]
    _assert_speculated(reference["accept"])


# ---- (b) staggered concurrent requests ----

def test_staggered_concurrent_requests_equal_one_by_one(pool, reference):
    srv = pool.get("overlap")
    offset = len(srv.log())
    outs, peak = _staggered(srv, reference["prompts"], reference["lengths"])
    assert _ids(outs) == reference["ids"]
    assert peak >= 4, peak  # the requests really shared decode batches
    _assert_speculated([o["meta_info"]["spec_accept_length"] for o in outs])
    assert not _tracebacks_since(srv, offset)


# ---- (c) aborts mid-generation ----

LONG = 3000  # new tokens: far more than the test waits for (prompt + LONG < the 4096-token KV pool)


def _wait_idle(srv, timeout_s: float) -> float:
    t0 = time.monotonic()
    while _running(srv):
        assert time.monotonic() - t0 < timeout_s, f"requests still running after {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def _assert_serving(srv, reference, offset: int) -> None:
    """After an abort: nothing left running, no KV held, the next request is exact, no traceback."""
    loads = _get(srv, "/v1/loads")["loads"][0]
    assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0, loads
    assert loads["num_used_tokens"] == 0, loads  # the aborted request's KV went back to the pool
    out = _generate(srv, reference["prompts"][0], reference["lengths"][0])
    assert out["output_ids"] == reference["ids"][0]
    assert out["meta_info"]["spec_accept_length"] > 1.0
    assert not _tracebacks_since(srv, offset), _tracebacks_since(srv, offset)


def test_closing_a_streaming_request_aborts_it_and_the_server_keeps_serving(pool, reference):
    """A long streaming request is cancelled by closing its connection while another request shares its
    batch: the other request's output is unchanged, and the long one stops (SGLang aborts it ~2 s after
    the disconnect) long before it could have finished."""
    srv = pool.get("overlap")
    offset = len(srv.log())
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    body = {"text": reference["prompts"][3], "stream": True, "rid": f"stream-{uuid.uuid4().hex}",
            "sampling_params": {"temperature": 0.0, "max_new_tokens": LONG, "ignore_eos": True}}
    conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    other: dict = {}
    neighbour = threading.Thread(
        target=lambda: other.update(_generate(srv, reference["prompts"][1], reference["lengths"][1])))
    received, t0 = 0, time.monotonic()
    for raw in resp:  # server-sent events: `data: {...}` per step
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        received = len(json.loads(line[len(b"data: "):])["output_ids"])
        if received >= 8 and not neighbour.is_alive() and not other:
            neighbour.start()  # joins the long request's batch mid-generation
        if received >= 48:
            break
    rate = received / (time.monotonic() - t0)
    conn.close()  # the client goes away mid-generation
    neighbour.join(120)
    assert other["output_ids"] == reference["ids"][1]
    waited = _wait_idle(srv, timeout_s=60)
    # at the rate it streamed, the rest of the request would have needed (LONG - received) / rate seconds
    assert waited < 0.5 * (LONG - received) / rate, (waited, received, rate)
    _assert_serving(srv, reference, offset)


def test_abort_request_endpoint_stops_a_request_and_the_server_keeps_serving(pool, reference):
    """SGLang's /abort_request with the request's rid, while another request shares the batch."""
    srv = pool.get("overlap")
    offset = len(srv.log())
    rid = f"abort-{uuid.uuid4().hex}"
    long_out: dict = {}
    other: dict = {}
    long_req = threading.Thread(target=lambda: long_out.update(_generate(srv, reference["prompts"][2], LONG, rid=rid)))
    neighbour = threading.Thread(
        target=lambda: other.update(_generate(srv, reference["prompts"][4], reference["lengths"][4])))
    long_req.start()
    t0 = time.monotonic()
    while _running(srv) == 0:  # wait until it is decoding
        assert time.monotonic() - t0 < 60
        time.sleep(0.05)
    neighbour.start()
    time.sleep(1.0)
    req = urllib.request.Request(srv.url + "/abort_request", data=json.dumps({"rid": rid}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:  # 200 with an empty body
        assert r.status == 200
    long_req.join(120)
    neighbour.join(120)
    assert long_out["meta_info"]["finish_reason"]["type"] == "abort", long_out["meta_info"]
    assert 0 < len(long_out["output_ids"]) < LONG
    assert other["output_ids"] == reference["ids"][4]
    _wait_idle(srv, timeout_s=30)
    _assert_serving(srv, reference, offset)


# ---- (a) overlap scheduling on and off (last: it switches servers) ----

def _overlap_state(srv) -> tuple[bool, bool]:
    """disable_overlap_schedule as resolved by the launcher and as the scheduler process itself holds it
    (`internal_states` come from the scheduler; its event loop is the overlap loop iff this is False)."""
    info = _get(srv, "/server_info")
    return info["disable_overlap_schedule"], info["internal_states"][0]["disable_overlap_schedule"]


def test_overlap_on_and_off_give_identical_greedy_outputs(pool, reference):
    srv = pool.get("overlap")
    assert _overlap_state(srv) == (False, False)
    log = srv.log()
    assert "'disable_overlap_schedule': False" in log and "'speculative_algorithm': 'HSPEC'" in log
    # SGLang turns overlap off on CPU for EAGLE and NGRAM (not for the DSpark family): not here
    assert "Overlap schedule is not implemented for speculative decoding on CPU" not in log
    overlap_batched = _ids(srv.generate(reference["prompts"], max(reference["lengths"])))

    srv = pool.get("no_overlap")
    assert _overlap_state(srv) == (True, True)
    assert "'disable_overlap_schedule': True" in srv.log()
    one_by_one = _one_by_one(srv, reference["prompts"], reference["lengths"])
    assert _ids(one_by_one) == reference["ids"]
    _assert_speculated([o["meta_info"]["spec_accept_length"] for o in one_by_one])
    staggered, _ = _staggered(srv, reference["prompts"], reference["lengths"])
    assert _ids(staggered) == reference["ids"]
    # one batch of 16 with the longest length: overlap on and off agree, and extend the reference
    batched = _ids(srv.generate(reference["prompts"], max(reference["lengths"])))
    assert batched == overlap_batched
    assert [b[:n] for b, n in zip(batched, reference["lengths"])] == reference["ids"]
