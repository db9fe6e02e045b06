"""Launch a dev service as a separate process (as tests and the demo do) and wait until it listens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tether_devservices.recorder import read_records


class DevServiceDidNotStart(RuntimeError):
    """The dev service process exited or printed something unexpected before it was ready."""


@dataclass
class DevServiceProcess:
    """A dev service running in its own process; records effects to `record`."""

    kind: str
    record: Path
    host: str
    port: int
    process: subprocess.Popen[str]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def records(self) -> list[dict]:
        """Every effect recorded so far."""
        return read_records(self.record)

    def stop(self, timeout: float = 10) -> None:
        """Stop the process (SIGTERM, then SIGKILL if it does not exit)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> DevServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(kind: str, record: str | os.PathLike[str], port: int = 0, host: str = "127.0.0.1",
          delay_ms: int = 0) -> DevServiceProcess:
    """Start `python -m tether_devservices <kind>` and return once it reports its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether_devservices", kind, "--port", str(port), "--host", host, "--record", str(record),
         "--delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout is not None else ""
    try:
        ready = json.loads(line)
    except json.JSONDecodeError:
        proc.kill()
        proc.wait()
        raise DevServiceDidNotStart(f"{kind} dev service did not start (exit code {proc.poll()}, said {line!r})") from None
    return DevServiceProcess(kind, Path(record), ready["host"], int(ready["port"]), proc)
