"""Launch, query and stop a small SGLang server on CPU (loopback only), for tests.

Everything the CPU tier needs goes through the environment of the launched process (the scheduler and
detokenizer are its subprocesses and inherit it): nothing is active in a normal SGLang install.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "shim"
PLUGIN_DIR = HERE / "plugin"
CPU_PLUGIN_ENTRY = "sglang_cpu_testing"
READY_LINE = "The server is fired up and ready to roll!"
LAUNCHER = "sglang.launch_server"


def sglang_python() -> str:
    """The interpreter that runs the server: $HSPEC_SGLANG_PYTHON, else this one if it has sglang, else the
    repo's .venv-sglang."""
    if os.environ.get("HSPEC_SGLANG_PYTHON"):
        return os.environ["HSPEC_SGLANG_PYTHON"]
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    venv = HERE.parents[1] / ".venv-sglang" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def cpu_env(*, plugins: tuple[str, ...] = (CPU_PLUGIN_ENTRY,), base: dict | None = None) -> dict[str, str]:
    """The environment that turns on the CPU tier: CPU engine, the shim and plugin dirs first on
    PYTHONPATH, and a whitelist of plugin entry points (keeps unrelated installed plugins out)."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    extra = [str(SHIM_DIR), str(PLUGIN_DIR)]
    if env.get("PYTHONPATH"):
        extra.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(extra)
    env["SGLANG_PLUGINS"] = ",".join(plugins)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    # fix 9: schedulers and detokenizers fork from the launcher (test_sglang_cpu_e2e.py's HSPEC server keeps
    # SGLang's spawn, which loads the plugins afresh in each child, as on GPU)
    env.setdefault("SGLANG_CPU_TESTING_FORK", "1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ZygoteProcess:
    """A launcher forked by the zygote (zygote.py), with the part of `subprocess.Popen` that Server uses."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.call({"op": "poll", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"python -m {LAUNCHER}", timeout)
            time.sleep(0.1)
        return self.returncode


class Zygote:
    """One per test process, started on first use (the import it saves is paid once, ~30 s); its stdin
    closes, and it exits, when the test process does."""

    _instance: Zygote | None = None

    def __init__(self):
        self.proc = subprocess.Popen([sglang_python(), str(HERE / "zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=cpu_env(), text=True, bufsize=1)
        self.lock = threading.Lock()
        if json.loads(self.proc.stdout.readline() or "{}").get("ready") is not True:
            raise RuntimeError(f"the SGLang launch zygote ({HERE / 'zygote.py'}) did not start: exit "
                               f"{self.proc.poll()}; run it by hand to see its error")

    @classmethod
    def get(cls) -> Zygote:
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = Zygote()
        return cls._instance

    def call(self, request: dict) -> dict:
        with self.lock:  # one request and its reply at a time (servers may be stopped from other threads)
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def launch(self, argv: list[str], *, env: dict, log_path: Path, module: str = LAUNCHER,
               cwd: Path | None = None) -> ZygoteProcess:
        pid = self.call({"op": "launch", "argv": argv, "env": env, "log": str(log_path), "module": module,
                         "cwd": str(cwd or os.getcwd())})["pid"]
        return ZygoteProcess(self, pid)


def start_launcher(argv: list[str], *, env: dict, log_path: Path):
    """`python -m sglang.launch_server *argv` in its own session, output to log_path: a fork of the zygote
    (SGLANG_CPU_TESTING_ZYGOTE=1, the default) or a fresh interpreter."""
    if env.get("SGLANG_CPU_TESTING_ZYGOTE", "1") == "1":
        return Zygote.get().launch(argv, env=env, log_path=log_path)
    with open(log_path, "wb") as fh:
        return subprocess.Popen([sglang_python(), "-m", LAUNCHER, *argv], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


@dataclass
class Server:
    proc: subprocess.Popen | ZygoteProcess
    port: int
    log_path: Path
    started_s: float = 0.0
    ready_s: float = field(default=0.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def serving_log(self) -> str:
        """What the server logged once ready ("fired up and ready to roll"). Before that line SGLang may log
        one benign traceback of its own: the post-warmup /freeze_gc request can race the HTTP listener on a
        loaded machine ("post-warmup freeze_gc failed"), which says nothing about serving."""
        log = self.log()
        ready = log.find(READY_LINE)
        return log[ready:] if ready >= 0 else log

    def get(self, path: str, timeout: float = 60.0) -> dict | list:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, payload: dict, timeout: float = 300.0) -> dict | list:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def generate(self, prompts: list[str] | list[list[int]], max_new_tokens: int, **sampling) -> list[dict]:
        """One batched /generate call; greedy with ignore_eos unless told otherwise."""
        key = "input_ids" if prompts and isinstance(prompts[0], list) else "text"
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
        out = self.post("/generate", {key: prompts, "sampling_params": params})
        return out if isinstance(out, list) else [out]

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the launcher's process group (scheduler and detokenizer included), then SIGKILL
        what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group, if any
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def launch(
    model_path: Path,
    *,
    log_path: Path,
    args: list[str] = (),
    plugins: tuple[str, ...] = (CPU_PLUGIN_ENTRY,),
    env_extra: dict[str, str] | None = None,
    dtype: str = "float32",
    max_total_tokens: int | None = 4096,
    timeout: float = 300.0,
) -> Server:
    """Start `python -m sglang.launch_server` on a free loopback port and wait until it is ready.
    `max_total_tokens=None` lets SGLang size the KV pool from its memory budget (on CPU: free host RAM,
    or a fixed budget through the CPU plugin's SGLANG_CPU_TESTING_KV_BUDGET_MB).
    Raises RuntimeError with the log tail when it dies or does not come up in time. A launch whose HTTP port
    was taken between `free_port` and SGLang's bind (another server's internal ports can land on it while
    both start) is retried on a fresh port, up to BIND_ATTEMPTS times."""
    for attempt in range(1, BIND_ATTEMPTS + 1):
        try:
            return _launch_once(model_path, log_path=log_path, args=args, plugins=plugins, env_extra=env_extra,
                                dtype=dtype, max_total_tokens=max_total_tokens, timeout=timeout)
        except PortTakenError:
            if attempt == BIND_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


BIND_ATTEMPTS = 3
PORT_TAKEN = "error while attempting to bind on address"


class PortTakenError(RuntimeError):
    """The server could not bind its HTTP port (taken after free_port chose it)."""


def _launch_once(model_path: Path, *, log_path: Path, args, plugins, env_extra, dtype, max_total_tokens,
                 timeout: float) -> Server:
    port = free_port()
    argv = [
        "--model-path", str(model_path), "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port), "--skip-server-warmup", "--disable-cuda-graph",
        # An idle SGLang scheduler otherwise polls at 100 % of a core; a module's idle servers would take the
        # CPU from the test that is running.
        "--sleep-on-idle", "--dtype", dtype,
        *(["--max-total-tokens", str(max_total_tokens)] if max_total_tokens is not None else []), *args,
    ]
    env = cpu_env(plugins=plugins)
    env.update(env_extra or {})
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # Own process group: stop() reaches the scheduler/detokenizer children too.
    proc = start_launcher(argv, env=env, log_path=log_path)
    server = Server(proc=proc, port=port, log_path=log_path, started_s=t0)
    try:
        while True:
            exited, log = proc.poll() is not None, server.log()
            if exited:
                error = PortTakenError if PORT_TAKEN in log else RuntimeError
                raise error(f"sglang server exited with {proc.returncode}:\n{log[-6000:]}")
            if PORT_TAKEN in log:  # the port answering /health would be another process's
                raise PortTakenError(f"sglang server could not bind port {port}:\n{log[-6000:]}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"sglang server not ready after {timeout:.0f} s:\n{server.log()[-6000:]}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
    except BaseException:
        server.stop()
        raise
    server.ready_s = time.monotonic() - t0
    return server
