"""Sizes for people: "1.3 MB" rather than "0.00 GB" for a small model.

The one size formatter: a source's size (catalog.sources.human_size), the memory estimate's
words (fleet.footprint), `model plan` and the serve quota's refusals (registry.quota) all print
through it, so one file is one figure wherever it is shown (tests/llmgw/test_units.py).
"""

from __future__ import annotations


def format_bytes(size: float) -> str:
    """A byte count in the largest unit that keeps it at 1 or more: B, KB, MB, GB, TB.

    Units are powers of 1024, as memory_gb in a profile is, so an estimate and a
    reservation compare at sight.
    """
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TB"
