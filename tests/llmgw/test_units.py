"""llmgw.units.format_bytes: the one size formatter, and the doors that print sizes through it."""

from __future__ import annotations

import pytest

from catalog.sources import human_size
from fleet.footprint import Estimate
from llmgw.units import format_bytes

SIZES = [
    (0, "0 B"),
    (1023, "1023 B"),
    (1024, "1.00 KB"),
    (501 * 1000, "489.26 KB"),
    (4_100_000_000, "3.82 GB"),
    (5 * 1024**4, "5.00 TB"),
]


@pytest.mark.parametrize(("size", "text"), SIZES)
def test_it_prints_powers_of_1024_as_memory_gb_counts_them(size: int, text: str) -> None:
    assert format_bytes(size) == text


@pytest.mark.parametrize(("size", "text"), SIZES)
def test_it_is_the_catalogs_source_size(size: int, text: str) -> None:
    # `model add` printed 4.1 GB for the file `model plan` called 3.82 GB (decimal units there).
    assert human_size(size) == text


def test_an_unknown_source_size_says_so() -> None:
    assert human_size(None) == "size unknown"


def test_the_memory_estimate_words_use_it() -> None:
    estimate = Estimate(
        weights_bytes=4_100_000_000,
        kv_cache_bytes=1024**3,
        prompt_cache_bytes=512 * 1024**2,
        context_length=4096,
        slots=2,
    )
    assert estimate.words() == (
        "weights 3.82 GB + KV cache 1.00 GB for 2 slots x 4096 tokens + prompt cache 512.00 MB"
    )
