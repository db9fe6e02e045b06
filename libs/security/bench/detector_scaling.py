"""How long `wrap_untrusted` (sanitize + the injection detector's scan) takes on adversarial tool
output, at two sizes: linear patterns take about twice as long at twice the size, quadratic ones
four times. Untrusted output reaches it whole (it scans before truncating), so a quadratic
pattern is CPU a tool result can burn in the planner.

    .venv/bin/python libs/security/bench/detector_scaling.py [--size 60000]
"""

from __future__ import annotations

import argparse
import os
import time

from tether_security.untrusted import wrap_untrusted


def cases(n: int) -> dict[str, str]:
    return {
        "hex dump": os.urandom(n // 2).hex(),
        "a-a-a-": "a-" * (n // 2),
        "a.a.a.": "a." * (n // 2),
        "<<<": "<" * n,
        "<a <a ": "<a " * (n // 3),
        "![![": "![" * (n // 2),
        "image url ???": "![x](http://a.com/" + "?" * n,
        "<!--<!--": "<!--" * (n // 4),
        "prose": "the quick brown fox jumps over the lazy dog. " * (n // 45),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=60_000, help="characters of the larger input")
    size = parser.parse_args().size
    print(f"{'case':16s} {'ms at ' + str(size // 2):>12s} {'ms at ' + str(size):>12s} {'ratio':>6s}")
    small, large = cases(size // 2), cases(size)
    for name in small:
        times = []
        for text in (small[name], large[name]):
            start = time.perf_counter()
            wrap_untrusted(text, source="bench", call_id="c")
            times.append((time.perf_counter() - start) * 1000)
        print(f"{name:16s} {times[0]:12.1f} {times[1]:12.1f} {times[1] / max(times[0], 1e-6):6.1f}")


if __name__ == "__main__":
    main()
