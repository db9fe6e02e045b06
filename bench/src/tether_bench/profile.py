"""Summarise py-spy raw (collapsed) profiles: where a service spends its samples, own and inclusive.

    python -m tether_bench.profile .state/bench/<time>/profile-tool-gateway.txt [--top 25]
"""

from __future__ import annotations

import argparse
import re
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for path in args.profiles:
        print(summarise(path, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
