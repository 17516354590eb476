"""Faults under the configuration users run: HSPEC on the embedded target (SmolLM2-135M-Instruct) with the
shipped drafter, the speculation switch on (HSPEC_SPECULATION=auto: compact verify, an SPS table with
plain-decode probes, the shipped STS) and prompt lookup spliced in (HSPEC_LOOKUP=1, so overlap scheduling
off), as scripts/bench_serve_cpu.sh launches `HSPEC+auto+lookup`; float32 greedy, through the CPU tier. The
drafter is a private copy of the shipped checkpoint, so a test can damage it.

- the drafter's model.safetensors deleted, truncated or overwritten in place while the server runs: the
  server keeps serving the tokens it served before (its weights are copies made at load, never a view of
  the file), with drafts still accepted, and logs no traceback;
- `/update_weights_from_disk` with the target's own checkpoint (SGLang's in-place weight update; the only
  way a running server reads a checkpoint again): SGLang hands that path to every runner, but the HSPEC
  worker keeps its drafter out of weight updates, so the target reloads, answers 200 and serves the same
  tokens (before that, the drafter's strict loader refused the target's weights and the server died);
- a launch on a damaged drafter fails in the launcher, before serving, with an error that names the file;
- the server SIGKILLed (launcher, scheduler, detokenizer) while a stream, a non-streamed request and an
  async stream of the client SDK are in flight: each raises ServerUnavailableError within seconds, and
  calls to the dead server afterwards do too.

One server at a time (two cores): the module's server is relaunched only after a test killed it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
SHIPPED_STS = REPO / "docs" / "results" / "calibration" / "sts_hspec_smollm2.json"
# The table HSPEC_AUTO_PROFILE_SPS=1 measured for this target and drafter in float32 on a 2-core EPYC, plain
# probes included: the switch needs them, and profiling afresh here would cost minutes per run.
MEASURED_SPS = REPO / "docs" / "results" / "serving" / "2026-12-05_epyc-zen5_fp32" / "sps_auto_profiled.json"
DEFAULTS_ENV = {"SGLANG_RAGGED_VERIFY_MODE": "compact", "HSPEC_SPECULATION": "auto", "HSPEC_LOOKUP": "1"}
PLUGINS = ("sglang_cpu_testing", "hspec")
N_PROMPTS, MAX_NEW = 4, 32
# A killed server's sockets are closed by the kernel at once: a call may take this long to notice, never
# its data timeout (120 s below).
KILLED_BOUND_S = 10.0
CLIENT_TIMEOUT_S = 120.0


def server_args(drafter: Path, *, sps_table: Path | None = MEASURED_SPS) -> list[str]:
    return ["--speculative-algorithm", "HSPEC", "--speculative-draft-model-path", str(drafter),
            *(["--speculative-dspark-sps-table-path", str(sps_table)] if sps_table else []),
            "--speculative-dspark-confidence-sts-path", str(SHIPPED_STS), "--disable-overlap-schedule"]


def private_drafter(dst: Path) -> Path:
    from sglang_hspec.engine.loading import SHIPPED_DRAFTER_DIR

    shutil.copytree(SHIPPED_DRAFTER_DIR, dst)
    return dst


class ServedDefaults:
    """The module's HSPEC server on a private drafter copy, with the outputs it served first (`baseline`);
    `live()` relaunches it (on a pristine copy) when a test killed it."""

    def __init__(self, root: Path):
        from transformers import AutoTokenizer

        from sglang_hspec.assets.embedded import embedded_target_dir
        from sglang_hspec.assets.prompts import chat_input_ids, load_prompts

        self.root, self.target = root, embedded_target_dir()
        tok = AutoTokenizer.from_pretrained(self.target)
        self.prompts = [chat_input_ids(tok, it.messages(0)) for it in load_prompts("mtbench", limit=N_PROMPTS)]
        self.server = None
        self.launches = 0
        self.baseline: list[list[int]] | None = None

    @property
    def drafter(self) -> Path:
        return self.root / f"drafter_{self.launches}"

    def live(self):
        from sglang_cpu import server as cpu_server

        if self.server is not None and self.server.proc.poll() is None:
            return self.server
        if self.server is not None:
            self.server.stop()
        self.launches += 1
        private_drafter(self.drafter)
        self.server = cpu_server.launch(self.target, log_path=self.root / f"hspec_{self.launches}.log",
                                        plugins=PLUGINS, env_extra=DEFAULTS_ENV, args=server_args(self.drafter))
        outs = self.server.generate(self.prompts, MAX_NEW)
        if self.baseline is None:
            self.baseline = [o["output_ids"] for o in outs]
        else:  # a relaunch serves what the first launch served
            assert [o["output_ids"] for o in outs] == self.baseline
        return self.server

    def generate(self):
        return self.live().generate(self.prompts, MAX_NEW)

    def restore_drafter(self) -> None:
        shutil.rmtree(self.drafter)
        private_drafter(self.drafter)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    holder = ServedDefaults(tmp_path_factory.mktemp("faults"))
    holder.live()
    log = holder.server.log()
    # the configuration under test is in effect, not a silent fallback
    assert "HSPEC: speculation policy auto (HSPEC_SPECULATION)" in log
    assert "prompt lookup spliced into argmax-drafted blocks" in log
    try:
        yield holder
    finally:
        holder.stop()


def tokens_per_verify_step(outs: list[dict]) -> float:
    metas = [o["meta_info"] for o in outs]
    return sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)


def delete(file: Path) -> None:
    file.unlink()


def truncate(file: Path) -> None:
    os.truncate(file, 1000)  # the same inode, shorter: a mapped file's tail pages would fault (SIGBUS)


def overwrite_in_place(file: Path) -> None:
    size = file.stat().st_size
    with open(file, "r+b") as fh:  # the same inode: a mapped file would change under the weights
        fh.write(os.urandom(size))


@pytest.mark.parametrize("damage", [delete, truncate, overwrite_in_place], ids=lambda f: f.__name__)
def test_drafter_file_damaged_while_serving_keeps_the_tokens(served, damage):
    served.live()
    file = served.drafter / "model.safetensors"
    damage(file)
    try:
        outs = served.generate()
        again = served.generate()
    finally:
        served.restore_drafter()
    assert [o["output_ids"] for o in outs] == served.baseline
    assert [o["output_ids"] for o in again] == served.baseline
    assert all(o["meta_info"]["completion_tokens"] == MAX_NEW for o in outs)
    # the drafter still drafts (from the weights it loaded): more than one token per verify step
    assert tokens_per_verify_step(outs) > 1.0, [o["meta_info"] for o in outs]
    assert "Traceback" not in served.server.serving_log()


def test_server_killed_mid_stream_raises_typed_errors_promptly(served, record_property):
    """SIGKILL to the launcher's process group (scheduler and detokenizer included) with three requests in
    flight: the sync stream (mid-stream), a non-streamed /generate and an async stream."""
    from sglang_cpu import load

    from sglang_hspec.client import AsyncHSpecClient, HSpecClient, ServerUnavailableError

    srv = served.live()
    prompt, long_generation = served.prompts[0], 1000  # minutes of decoding: still running when killed
    outcomes: dict[str, BaseException | object] = {}

    def non_streamed():
        with HSpecClient(srv.url, timeout=CLIENT_TIMEOUT_S, retries=1) as client:
            try:
                outcomes["generate"] = client.generate(input_ids=prompt, max_new_tokens=long_generation, ignore_eos=True)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcomes["generate"] = exc
            outcomes["generate_s"] = time.monotonic()

    def async_stream():
        async def run():
            async with AsyncHSpecClient(srv.url, timeout=CLIENT_TIMEOUT_S, retries=1) as client:
                chunks = 0
                try:
                    async for _ in client.generate_stream(input_ids=prompt, max_new_tokens=long_generation,
                                                          ignore_eos=True):
                        chunks += 1
                        outcomes["async_chunks"] = chunks
                    outcomes["async_stream"] = "finished"
                except BaseException as exc:  # noqa: BLE001 - asserted below
                    outcomes["async_stream"] = exc
                outcomes["async_stream_s"] = time.monotonic()

        asyncio.run(run())

    threads = [threading.Thread(target=non_streamed, daemon=True), threading.Thread(target=async_stream, daemon=True)]
    for t in threads:
        t.start()
    client = HSpecClient(srv.url, timeout=CLIENT_TIMEOUT_S, retries=1)
    stream = client.generate_stream(input_ids=prompt, max_new_tokens=long_generation, ignore_eos=True)
    received = [next(stream) for _ in range(3)]
    deadline = time.monotonic() + 120
    while load.loads(srv.url)["num_running_reqs"] < 3 or outcomes.get("async_chunks", 0) < 1:
        assert time.monotonic() < deadline, f"the three requests are not all running: {load.loads(srv.url)}"
        time.sleep(0.2)
    assert sum(len(c.output_ids_delta) for c in received) >= 3 and all(c.result is None for c in received)

    group = srv.proc.pid  # the launcher leads its own session; its children share the group
    killed_at = time.monotonic()
    os.killpg(group, signal.SIGKILL)
    with pytest.raises(ServerUnavailableError, match="dropped the connection"):
        for _ in stream:
            pass
    stream_s = time.monotonic() - killed_at
    assert stream_s < KILLED_BOUND_S
    for t in threads:
        t.join(KILLED_BOUND_S)
        assert not t.is_alive(), f"a client call still hangs {KILLED_BOUND_S:g} s after the kill: {outcomes}"
    for name in ("generate", "async_stream"):
        assert isinstance(outcomes[name], ServerUnavailableError), (name, outcomes[name])
        assert "dropped the connection" in str(outcomes[name]), str(outcomes[name])
        assert outcomes[f"{name}_s"] - killed_at < KILLED_BOUND_S
    seconds = {"stream": stream_s, **{name: outcomes[f"{name}_s"] - killed_at for name in ("generate", "async_stream")}}
    record_property("raised_after_kill_s", seconds)
    print("seconds from SIGKILL to the client's error:", {k: round(v, 3) for k, v in seconds.items()})
    assert srv.proc.wait(timeout=30) == -signal.SIGKILL
    gone_by = time.monotonic() + KILLED_BOUND_S  # SIGKILL is delivered at once; their exit may lag a little
    while process_group_members(group) and time.monotonic() < gone_by:
        time.sleep(0.2)
    assert not process_group_members(group), "processes of the killed server survive"

    # the dead server: every call is refused at once (after the connect retry's backoff)
    for call in (lambda: client.generate(input_ids=prompt, max_new_tokens=4),
                 lambda: list(client.generate_stream(input_ids=prompt, max_new_tokens=4)),
                 lambda: client.chat([{"role": "user", "content": "Hi"}], max_tokens=4)):
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="cannot connect"):
            call()
        refused_s = time.monotonic() - t0
        print(f"a call to the dead server raised after {refused_s:.3f} s")
        assert refused_s < KILLED_BOUND_S
    assert client.health() is False
    client.close()


def process_group_members(group: int) -> list[int]:
    """Live processes in a process group (Linux /proc; zombies count as gone)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


@pytest.fixture(scope="module")
def target_weight_update(served):
    """POST /update_weights_from_disk with the target's own checkpoint (the weights it serves) to the module
    server, then what happened: the HTTP status (None: no answer), the body or error, and the outputs
    after it (None: the server is gone)."""
    from sglang_cpu import load

    srv = served.live()
    # SGLang flushes the prefix cache after the update only on an idle scheduler: let the last batch retire
    assert not any(load.wait_drained(srv.url).values())
    time.sleep(1.0)
    request = urllib.request.Request(srv.url + "/update_weights_from_disk",
                                     data=json.dumps({"model_path": str(served.target)}).encode(),
                                     headers={"Content-Type": "application/json"})
    status, answer = None, None
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            status, answer = r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError) as exc:
        answer = repr(exc)
    try:
        srv.proc.wait(timeout=30)  # the scheduler's death takes the launcher down within seconds
    except Exception:  # noqa: BLE001 - still running
        pass
    outs = served.generate() if srv.proc.poll() is None else None
    return {"status": status, "answer": answer, "outs": outs, "log": srv.log()}


def test_target_weight_update_never_serves_wrong_tokens(served, target_weight_update):
    update = target_weight_update
    if update["outs"] is not None:  # it kept serving: with the same tokens, after an answer
        assert update["status"] is not None, update["answer"]
        assert [o["output_ids"] for o in update["outs"]] == served.baseline
    else:  # it failed loudly: no 200, and the log says why
        assert update["status"] != 200, update["answer"]
        assert "the H-Spec drafter checkpoint (write it with save_drafter) does not fit the model" in update["log"]


def test_target_weight_update_keeps_serving(served, target_weight_update):
    """The HSPEC worker keeps its drafter out of weight updates (weight_update_runners): the target reloads its
    own weights, answers 200 and serves the same tokens."""
    update = target_weight_update
    assert update["status"] == 200 and update["answer"]["success"] is True, update["answer"]
    assert [o["output_ids"] for o in update["outs"]] == served.baseline


@pytest.fixture(scope="module")
def launch_on_truncated_drafter(served, tmp_path_factory):
    """A launch (the module's configuration) on a drafter copy whose model.safetensors is cut to 1000 bytes:
    the error it stops with and how long it took. Runs after the module server stopped (one at a time)."""
    from sglang_cpu import server as cpu_server

    served.stop()
    root = tmp_path_factory.mktemp("truncated_drafter")
    drafter = private_drafter(root / "drafter")
    truncate(drafter / "model.safetensors")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        srv = cpu_server.launch(served.target, log_path=root / "server.log", plugins=PLUGINS, env_extra=DEFAULTS_ENV,
                                args=server_args(drafter), timeout=600)
        srv.stop()
    return {"error": str(info.value), "seconds": time.monotonic() - t0, "file": drafter / "model.safetensors"}


def test_launch_on_a_truncated_drafter_fails_before_serving(launch_on_truncated_drafter):
    error = launch_on_truncated_drafter["error"]
    assert "sglang server exited with" in error, error[-2000:]  # exited, never answered /health
    assert "Error while deserializing header" in error, error[-2000:]


def test_launch_on_a_truncated_drafter_names_the_file(launch_on_truncated_drafter):
    """The launcher reads the drafter's safetensors header (check_checkpoint_weights_readable) before any server
    process starts, and names the file and the fix."""
    error = launch_on_truncated_drafter["error"]
    assert f"{launch_on_truncated_drafter['file']} cannot be read as safetensors" in error, error[-2000:]
    assert "it is truncated or damaged; re-copy the checkpoint" in error, error[-2000:]
    assert launch_on_truncated_drafter["seconds"] < 60
