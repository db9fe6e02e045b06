"""ServiceProcess runs a real `python -m` process: health wait, kill by signal, restart, log capture, cleanup."""

from __future__ import annotations

import os
import signal
import textwrap
import urllib.request

import pytest

from tether_testing.processes import ServiceFailed, ServiceProcess, ServiceProcesses, free_port

# A tiny service: /healthz answers 200 once listening; it may first start a child or exit early.
SERVICE = textwrap.dedent("""
    import http.server, os, subprocess, sys
    print(f"fake service pid={os.getpid()}", flush=True)
    if os.environ.get("EXIT_AT_START"):
        print("giving up", file=sys.stderr, flush=True)
        sys.exit(int(os.environ["EXIT_AT_START"]))
    if os.environ.get("START_CHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"child pid={child.pid}", flush=True)
    if os.environ.get("NEVER_HEALTHY"):
        import time; time.sleep(600)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", int(os.environ["HEALTH_PORT"])), Health).serve_forever()
""")


@pytest.fixture
def service_env(tmp_path):
    (tmp_path / "fake_service.py").write_text(SERVICE)
    port = free_port()
    return port, {"PYTHONPATH": str(tmp_path), "HEALTH_PORT": str(port)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_start_waits_for_health_and_captures_output(tmp_path, service_env):
    port, env = service_env
    with ServiceProcess("fake_service", health_port=port, env=env, log_dir=tmp_path / "logs") as svc:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200
        assert f"fake service pid={svc.pid}" in svc.log_text()
        assert svc.log_path.parent == tmp_path / "logs"
    assert not svc.running


def test_kill_is_a_crash_and_restart_brings_up_a_new_process(tmp_path, service_env):
    port, env = service_env
    svc = ServiceProcess("fake_service", health_port=port, env=env, log_dir=tmp_path).start()
    try:
        first = svc.pid
        assert svc.kill(signal.SIGKILL) == -signal.SIGKILL
        assert not svc.healthy() and not _alive(first)
        svc.restart()
        assert svc.pid != first and svc.healthy()
        assert svc.log_text().count("fake service pid=") == 2
    finally:
        svc.stop()
    assert not svc.running


def test_kill_with_sigterm_lets_the_process_exit(tmp_path, service_env):
    port, env = service_env
    svc = ServiceProcess("fake_service", health_port=port, env=env, log_dir=tmp_path).start()
    try:
        assert svc.kill(signal.SIGTERM) == -signal.SIGTERM
    finally:
        svc.stop()


def test_a_service_that_exits_at_start_fails_with_its_log(tmp_path, service_env):
    port, env = service_env
    svc = ServiceProcess("fake_service", health_port=port, env={**env, "EXIT_AT_START": "7"}, log_dir=tmp_path)
    with pytest.raises(ServiceFailed, match="exited with status 7") as info:
        svc.start()
    assert "giving up" in str(info.value)


def test_a_service_that_never_gets_healthy_is_stopped(tmp_path, service_env):
    port, env = service_env
    svc = ServiceProcess("fake_service", health_port=port, env={**env, "NEVER_HEALTHY": "1"}, log_dir=tmp_path)
    with pytest.raises(ServiceFailed, match="did not return 200"):
        svc.start(timeout=2)
    assert not svc.running and not _alive(svc.pid)


def test_stop_all_stops_every_service_and_their_children(tmp_path, service_env):
    port, env = service_env
    other_port = free_port()
    group = ServiceProcesses(tmp_path)
    first = group.start("fake_service", health_port=port, env={**env, "START_CHILD": "1"}, name="first")
    second = group.start("fake_service", health_port=other_port, env={**env, "HEALTH_PORT": str(other_port)},
                         name="second")
    child = int(first.log_text().split("child pid=")[1].split()[0])
    assert _alive(child)
    group.stop_all()
    assert not first.running and not second.running
    assert not _alive(child)
    assert {p.name for p in (tmp_path).iterdir()} >= {"first.log", "second.log"}
