"""bench/side_by_side.py: a server that fails to start, or whose start is interrupted, leaves no process behind."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real processes started, killed and waited for: about 5 s

_spec = importlib.util.spec_from_file_location("side_by_side", Path(__file__).parents[2] / "bench" / "side_by_side.py")
side_by_side = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(side_by_side)

# A "server" that starts a child (what a real server's workers are) and writes its pid, then exits or idles.
_SERVER = "import subprocess, sys; c = subprocess.Popen(['sleep', '300']); open(sys.argv[1], 'w').write(str(c.pid)); "


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited: only its parent (here: init) has yet to reap it


def child_pid(pidfile: Path) -> int:
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            return int(pidfile.read_text())
        time.sleep(0.05)
    raise AssertionError("the fake server never started its child")


def serve(tmp_path: Path, code: str):
    return side_by_side.Served(
        "fake",
        [sys.executable, "-c", _SERVER + code, str(tmp_path / "pid")],
        dict(os.environ),
        "http://127.0.0.1:9/v1",
        tmp_path / "log",
    )


def test_a_server_that_exits_during_startup_takes_its_children_with_it(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 3"):
        serve(tmp_path, "import time; time.sleep(0.5); sys.exit(3)")
    child = child_pid(tmp_path / "pid")
    time.sleep(0.2)
    assert not alive(child)


def test_ctrl_c_while_waiting_for_a_server_stops_it(tmp_path, monkeypatch):
    polls = []

    def interrupted(*args, **kwargs):
        if len(polls) > 3:  # once the fake server is up: Ctrl-C
            raise KeyboardInterrupt
        polls.append(1)
        raise side_by_side.httpx.ConnectError("refused")

    monkeypatch.setattr(side_by_side.httpx, "get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        serve(tmp_path, "import time; time.sleep(300)")
    child = child_pid(tmp_path / "pid")
    time.sleep(0.2)
    assert not alive(child)
