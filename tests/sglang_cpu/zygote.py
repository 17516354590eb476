"""A fork server for `python -m sglang.launch_server` (tests only).

Importing `sglang.launch_server` costs ~14 CPU-seconds on the 2-core test machine, and all but ~0.3 s of it
is third-party packages (torch, transformers, scipy, sympy, pydantic, ...). The zygote imports those once;
each launch is then a fork of it that sets the launch's environment and argv and runs the launcher module
as `python -m` would. sglang itself (and every plugin) is imported afresh in the fork, after its
environment is set, because SGLang reads some variables at import (`spec_utils.SIMULATE_ACC_LEN`).

Protocol: JSON lines on stdin/stdout. {"op": "launch", "argv": [...], "env": {...}, "log": path, "cwd": dir,
optional "module" (default sglang.launch_server)} -> {"pid": n}; {"op": "poll", "pid": n} -> {"returncode": int | null}. Each fork leads its own session
(os.setsid), so the caller stops it with os.killpg; the zygote reaps it and remembers the exit status.
The zygote exits when its stdin closes (the test process ended).

Run: python tests/sglang_cpu/zygote.py, by the interpreter that has sglang (server.py starts one per test
process).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import traceback

LAUNCHER = "sglang.launch_server"


def third_party_modules() -> list[str]:
    """What importing the launcher loads, in load order, minus sglang's own modules and the plugins."""
    probe = ("import sys, json; before = set(sys.modules); import " + LAUNCHER + "; "
             "print(json.dumps([m for m in sys.modules if m not in before]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    names = json.loads(out.strip().splitlines()[-1])
    own = ("sglang", "sgl_kernel", "sglang_hspec", "sglang_cpu_testing", "__main__")
    return [m for m in names if m.split(".")[0] not in own]


def preload(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - optional backends fail to import here as they do in SGLang
            pass


def _run_launcher(request: dict) -> int:
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` has it (the zygote runs as a script: its own directory)
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    module = request.get("module", LAUNCHER)
    sys.argv = [module, *request["argv"]]
    import runpy

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then a non-zero exit
        traceback.print_exc()
        return 1


def serve() -> None:
    # replies go to the original stdout; anything an import prints goes to stderr instead of into them
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    preload(third_party_modules())
    exited: dict[int, int] = {}

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            exited[pid] = os.waitstatus_to_exitcode(status)

    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        reap()
        if request["op"] == "launch":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    out.close()
                    code = _run_launcher(request)
                finally:
                    try:
                        sys.stdout.flush()
                        sys.stderr.flush()
                    finally:
                        os._exit(code)
            reply = {"pid": pid}
        elif request["op"] == "poll":
            reply = {"returncode": exited.get(request["pid"])}
        else:
            reply = {"error": f"unknown op {request['op']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
