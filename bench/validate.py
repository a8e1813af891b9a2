"""The gateway's check of a request body (gateway.validate.refusal) on a long conversation.

A chat completion of 1,000 messages is checked 20 times a round, in 5 rounds; the best round's
time per check is printed beside its target (under 2 ms: a check is on every request's path,
before the engine is asked). It was a timed test of the suite until the suite ran on several
processes at once, where a timing says more about the neighbours than about the check.

Run: make bench, or .venv/bin/python bench/validate.py
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This file's folder holds a module named like the gateway package: keep it off the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

TARGET_SECONDS = 0.002


def main() -> int:
    from gateway.validate import chat, refusal
    from tests.gateway.test_validate import A_THOUSAND_MESSAGES as body

    assert refusal(chat, body) is None, "the body must be valid"
    best = min(timeit.repeat(lambda: refusal(chat, body), number=20, repeat=5)) / 20
    met = "met" if best < TARGET_SECONDS else "NOT met"
    print(f"a body of 1,000 messages checked in {best * 1000:.3f} ms (target < 2 ms: {met})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
