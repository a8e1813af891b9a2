"""Sizes for people: "1.3 MB" rather than "0.00 GB" for a small model.

The one home of the size rules, in two kinds:

- memory, in powers of 1024 as memory_gb in a profile is (format_bytes): a source's size
  (catalog.sources.human_size), the memory estimate's words (fleet.footprint), `model plan` and
  the serve quota's refusals (registry.quota), so one file is one figure wherever it is shown;
- files and transfers, in decimal units as the registry lists files (format_size, and
  format_progress for "200 of 500 kB"): the console's update and fetch views, `llmgw ctl model
  updates` and its progress bar, and a rollout's step.

tests/llmgw/test_units.py holds both.
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


# Decimal units for files and transfers, largest first.
_DECIMAL = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def _decimal_unit(size: float) -> tuple[str, float]:
    for unit, scale in _DECIMAL:
        if size >= scale:
            return unit, scale
    return "bytes", 1


def _figures(size: float, scale: float, whole: float) -> str:
    # Three figures are enough to compare sizes at a glance: 4.1 GB, 12.5 MB, 501 kB.
    return f"{size / scale:.0f}" if whole / scale >= 100 else f"{size / scale:.1f}"


def format_size(size: float | None) -> str:
    """A file's or a transfer's size: 812 bytes, 501 kB, 12.5 MB, 4.1 GB; "?" when unknown."""
    if size is None:
        return "?"
    unit, scale = _decimal_unit(size)
    return f"{size:.0f} bytes" if scale == 1 else f"{_figures(size, scale, size)} {unit}"


def format_progress(done: float, total: float) -> str:
    """ "200 of 500 kB": the part in the unit of the total, so the two compare at a glance."""
    _, scale = _decimal_unit(total)
    part = f"{done:.0f}" if scale == 1 else _figures(done, scale, total)
    return f"{part} of {format_size(total)}"
