"""The CPU tier's launch zygote (tests/sglang_cpu/zygote.py): a fork runs its module as `python -m` would,
with the launch's environment, argv, working directory and its own session, and reports the exit status;
the zygote has imported the third-party packages but not sglang, so sglang reads the launch's environment
at import."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.sglang]

PROBE = '''
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "flag": os.environ.get("ZYGOTE_TEST_FLAG"), "cwd": os.getcwd(),
                  "sid": os.getsid(0) == os.getpid(), "name": __name__,
                  "sglang_loaded": any(m == "sglang" or m.startswith("sglang.") for m in sys.modules),
                  "torch_loaded": "torch" in sys.modules}))
import sglang.srt.speculative.spec_utils as spec_utils
print("SIMULATE_ACC_LEN", spec_utils.SIMULATE_ACC_LEN)
sys.exit(int(sys.argv[-1]))
'''


def test_fork_runs_the_module_with_its_own_environment(tmp_path):
    import json

    from sglang_cpu import server as cpu_server

    (tmp_path / "zygote_probe.py").write_text(PROBE)
    env = cpu_server.cpu_env()
    env.update({"ZYGOTE_TEST_FLAG": "set-after-fork", "SGLANG_SIMULATE_ACC_LEN": "2.5",
                "PYTHONPATH": os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])})
    zygote = cpu_server.Zygote.get()
    runs = {}
    for code in (0, 3):
        log = tmp_path / f"probe{code}.log"
        proc = zygote.launch(["--x", str(code)], env=env, log_path=log, module="zygote_probe", cwd=tmp_path)
        assert proc.wait(timeout=120) == code
        runs[code] = log.read_text().splitlines()
    first = json.loads(runs[0][0])
    assert first == {"argv": ["--x", "0"], "flag": "set-after-fork", "cwd": str(tmp_path), "sid": True,
                     "name": "__main__", "sglang_loaded": False, "torch_loaded": True}
    # spec_utils reads SGLANG_SIMULATE_ACC_LEN when it is imported: in the fork, after the env was set
    assert [line for line in runs[0] if line.startswith("SIMULATE_ACC_LEN")] == ["SIMULATE_ACC_LEN 2.5"]
    assert json.loads(runs[3][0])["argv"] == ["--x", "3"]


def test_a_failing_launch_prints_its_traceback_and_exits_non_zero(tmp_path):
    from sglang_cpu import server as cpu_server

    (tmp_path / "zygote_boom.py").write_text("raise ValueError('the message a user reads')\n")
    env = cpu_server.cpu_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    log = tmp_path / "boom.log"
    proc = cpu_server.Zygote.get().launch([], env=env, log_path=log, module="zygote_boom", cwd=tmp_path)
    assert proc.wait(timeout=60) == 1
    out = log.read_text()
    assert "Traceback (most recent call last)" in out
    assert out.strip().splitlines()[-1] == "ValueError: the message a user reads"


def test_launch_retries_on_a_fresh_port_when_its_port_was_taken(tmp_path, monkeypatch):
    """A server whose HTTP port was taken between free_port and SGLang's bind (seen in CI: another server
    starting beside it) is relaunched on a fresh port; any other early exit is an error at once."""
    from sglang_cpu import server as cpu_server

    launches = []

    class Exited:
        pid, returncode = 0, 3

        def poll(self):
            return 3

        def wait(self, timeout=None):
            return 3

    def fake_launcher(argv, *, env, log_path):
        launches.append(int(argv[argv.index("--port") + 1]))
        taken = len(launches) < 3
        log_path.write_text(f"ERROR:    [Errno 98] {cpu_server.PORT_TAKEN} ('127.0.0.1', 1): address already in use"
                            if taken else "ValueError: a real startup error")
        return Exited()

    monkeypatch.setattr(cpu_server, "start_launcher", fake_launcher)
    monkeypatch.setattr(cpu_server.os, "killpg", lambda pid, sig: None)
    with pytest.raises(RuntimeError, match="a real startup error") as err:
        cpu_server.launch(tmp_path / "target", log_path=tmp_path / "server.log")
    assert not isinstance(err.value, cpu_server.PortTakenError)
    assert len(launches) == 3  # two taken ports, then the third launch's own error
    launches.clear()
    monkeypatch.setattr(cpu_server, "BIND_ATTEMPTS", 2)
    with pytest.raises(cpu_server.PortTakenError):
        cpu_server.launch(tmp_path / "target", log_path=tmp_path / "server.log")
    assert len(launches) == 2
