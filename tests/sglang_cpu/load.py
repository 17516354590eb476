"""Load and soak drivers for CPU SGLang servers (loopback only, bounded in count and time).

`overload` sends many more concurrent requests than the KV pool holds; `soak` keeps a bounded number of
random requests in flight for a fixed time and aborts a fraction of them. Both return plain dicts so the
tier's tests and `scripts/soak_sglang.py` report the same numbers.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor


def _post(url: str, path: str, payload: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body else {}


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


def loads(url: str) -> dict[str, int]:
    """Summed /v1/loads counters: running, waiting requests and KV tokens in use."""
    rows = _get(url, "/v1/loads")["loads"]
    return {key: sum(int(r[key]) for r in rows) for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")}


def wait_drained(url: str, *, timeout_s: float = 120.0) -> dict[str, int]:
    """Poll until nothing runs, waits or holds KV (or the timeout); returns the last counters."""
    t0 = time.monotonic()
    while True:
        now = loads(url)
        if not any(now.values()) or time.monotonic() - t0 > timeout_s:
            return now
        time.sleep(0.2)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def generate(url: str, prompt: str, max_new_tokens: int, *, rid: str | None = None, **sampling) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
    body = {"text": prompt, "sampling_params": params}
    if rid is not None:
        body["rid"] = rid
    return _post(url, "/generate", body)


def overload(url: str, prompts: list[str], lengths: list[int], *, workers: int) -> dict:
    """All requests at once from `workers` threads. Returns outputs (in order), failures and the peak
    number of waiting requests seen (> 0 means the pool really queued them)."""
    peak_waiting, done = 0, threading.Event()

    def watch():
        nonlocal peak_waiting
        while not done.is_set():
            peak_waiting = max(peak_waiting, loads(url)["num_waiting_reqs"])
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    failures: list[str] = []

    def one(i):
        try:
            return generate(url, prompts[i], lengths[i])["output_ids"]
        except Exception as e:  # noqa: BLE001 - counted and reported
            failures.append(f"request {i}: {e!r}")
            return None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        outputs = list(pool.map(one, range(len(prompts))))
    done.set()
    watcher.join()
    return {"outputs": outputs, "failures": failures, "peak_waiting": peak_waiting}


def soak(url: str, *, prompts: list[str], reference: list[list[int]] | None, duration_s: float,
         concurrency: int, max_new_tokens: tuple[int, int], abort_fraction: float, seed: int,
         server_pid: int | None = None, max_requests: int = 100_000, rss_every_s: float = 60.0) -> dict:
    """Random requests (prompt index, length) for `duration_s` seconds with `concurrency` in flight; each
    is aborted mid-generation through /abort_request with probability `abort_fraction`. Unaborted outputs
    are checked against `reference[prompt index][:length]` when given (greedy: every length is a prefix
    of the longest continuation). Bounded: stops after `duration_s` or `max_requests`. With `server_pid`,
    the server's RSS at the start and end and every `rss_every_s` seconds between (`rss_mib_series`,
    [seconds, MiB]), and its growth over the second half (`rss_second_half_pct`: warm-up is over by then,
    so a leak shows there)."""
    rng = random.Random(seed)
    lock = threading.Lock()
    stats = {"requests": 0, "completed": 0, "aborted": 0, "failed": 0, "mismatched": 0, "errors": []}
    deadline = time.monotonic() + duration_s
    rss_start = rss_bytes(server_pid) if server_pid else None
    start = time.monotonic()
    series: list[list[float]] = []
    stop_sampling = threading.Event()

    def sample_rss():
        while not stop_sampling.wait(rss_every_s):
            series.append([round(time.monotonic() - start, 1), round(rss_bytes(server_pid) / 2**20, 1)])

    sampler = threading.Thread(target=sample_rss, daemon=True) if server_pid else None
    if sampler is not None:
        sampler.start()

    def worker(worker_id: int):
        local = random.Random(rng.random())
        while time.monotonic() < deadline:
            with lock:
                if stats["requests"] >= max_requests:
                    return
                stats["requests"] += 1
            i = local.randrange(len(prompts))
            n = local.randint(*max_new_tokens)
            abort = local.random() < abort_fraction
            rid = f"soak-{worker_id}-{uuid.uuid4().hex}"
            if abort:
                delay = local.uniform(0.05, 0.5)
                threading.Timer(delay, lambda rid=rid: _abort(url, rid)).start()
            try:
                out = generate(url, prompts[i], n, rid=rid)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    stats["failed"] += 1
                    stats["errors"].append(f"{rid}: {e!r}")
                continue
            finish = (out.get("meta_info") or {}).get("finish_reason") or {}
            with lock:
                if finish.get("type") == "abort":
                    stats["aborted"] += 1
                    continue
                stats["completed"] += 1
                if reference is not None and out["output_ids"] != reference[i][:n]:
                    stats["mismatched"] += 1
                    stats["errors"].append(f"{rid}: prompt {i} x {n} tokens differs from the reference")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if sampler is not None:
        stop_sampling.set()
        sampler.join()
    after = wait_drained(url)
    stats["kv_tokens_leaked"] = after["num_used_tokens"]
    stats["left_running"] = after["num_running_reqs"] + after["num_waiting_reqs"]
    if server_pid:
        stats["rss_start_mib"] = round(rss_start / 2**20, 1)
        stats["rss_end_mib"] = round(rss_bytes(server_pid) / 2**20, 1)
        series.append([round(time.monotonic() - start, 1), stats["rss_end_mib"]])
        stats["rss_mib_series"] = series
        stats["rss_second_half_pct"] = second_half_growth_pct(series)
    stats["errors"] = stats["errors"][:20]
    return stats


def second_half_growth_pct(series: list[list[float]]) -> float | None:
    """Growth in % from the first sample at or after half the run to the last sample ([seconds, MiB] pairs);
    None with fewer than two samples in that half."""
    if not series:
        return None
    half = series[-1][0] / 2
    later = [mib for t, mib in series if t >= half]
    if len(later) < 2:
        return None
    return round(100.0 * (later[-1] - later[0]) / later[0], 2)


def _abort(url: str, rid: str) -> None:
    try:
        _post(url, "/abort_request", {"rid": rid}, timeout=60)
    except Exception:  # noqa: BLE001 - the request may have finished already
        pass
