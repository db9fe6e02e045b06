"""Summarise the bench's profiles: py-spy raw (collapsed) stacks of a service, own and inclusive
shares; a Java Flight Recording of the Kafka broker, by thread and by request type.

    python -m tether_bench.profile .state/bench/<time>/profile-tool-gateway.txt [--top 25]
    python -m tether_bench.profile .state/bench/<time>/profile-kafka.jfr
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def summarise(path: Path, top: int = 25) -> str:
    total = 0
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for frame in {_LINE.sub(")", f) for f in frames}:
            inclusive[frame] += n
    if not total:
        return f"{path}: no samples"
    lines = [f"{path.name}: {total} samples"]
    lines += [f"  own {n / total:6.1%}  {f}" for f, n in own.most_common(top)]
    boring = ("threading.py", "runpy.py", "<module>", "concurrent/futures/thread.py")
    lines += [f"  inc {n / total:6.1%}  {f}" for f, n in inclusive.most_common(top * 3)
              if not any(b in f for b in boring)][:top]
    return "\n".join(lines)


_JFR_SAMPLE = re.compile(r'sampledThread = "([^"]+)".*?stackTrace = \[(.*?)\n\s*\]', re.S)
_JFR_FRAME = re.compile(r"^\s+([\w$.<>]+)\(", re.M)
#: The frames that name what a broker thread was doing. A request: the type a handler thread
#: served (the outermost such frame, not what it calls), including a produce appended in the
#: callback after the transaction check (KIP-890) and the completion of delayed requests.
_JFR_REQUEST = re.compile(r"KafkaApis\.handle[A-Z]\w*|ReplicaManager\.\$anonfun\$handleProduceAppend|"
                          r"ReplicaManager\.tryCompleteActions")
#: Otherwise the part of the network thread, transaction or group coordinator (the innermost).
_JFR_PART = re.compile(r"network\.Processor\.(?!run\b)\w+|TransactionMarker\w*\.\w+|"
                       r"AddPartitionsToTxnManager\w*\.\w+|CoordinatorRuntime\$\w+\.run")
#: Scala's lambda decorations: `ReplicaManager.$anonfun$handleProduceAppend$11` → `…handleProduceAppend`.
_JFR_LAMBDA = re.compile(r"\$anonfun\$|\$\d+|\$adapted")


def summarise_jfr(path: Path, top: int = 25) -> str:
    """CPU samples (`jdk.ExecutionSample`) of a recording, by thread (numbers folded) and by activity."""
    jfr = shutil.which("jfr")
    if jfr is None:
        return f"{path}: `jfr` (part of the JDK) is not on PATH"
    text = subprocess.run([jfr, "print", "--stack-depth", "96", "--events", "jdk.ExecutionSample", str(path)],
                          capture_output=True, text=True, check=True, timeout=300).stdout
    threads: Counter[str] = Counter()
    activities: Counter[str] = Counter()
    for thread, stack in _JFR_SAMPLE.findall(text):
        thread = re.sub(r"\d+", "N", thread)
        threads[thread] += 1
        frames = _JFR_FRAME.findall(stack)  # innermost first
        requests = [f for f in frames if _JFR_REQUEST.search(f)]
        parts = [f for f in frames if _JFR_PART.search(f)]
        activity = requests[-1] if requests else parts[0] if parts else "(other)"
        activities[f"{thread}: {_JFR_LAMBDA.sub('', activity)}"] += 1
    total = sum(threads.values())
    if not total:
        return f"{path}: no CPU samples"
    lines = [f"{path.name}: {total} CPU samples"]
    lines += [f"  thread   {n / total:6.1%}  {t}" for t, n in threads.most_common(top)]
    lines += [f"  activity {n / total:6.1%}  {a}" for a, n in activities.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for path in args.profiles:
        print(summarise_jfr(path, args.top) if path.suffix == ".jfr" else summarise(path, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
