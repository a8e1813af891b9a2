"""llmgw.units.format_bytes: the one size formatter, and the doors that print sizes through it."""

from __future__ import annotations

import pytest

from catalog.sources import human_size
from fleet.footprint import Estimate
from llmgw.units import format_bytes, format_progress, format_size

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


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (None, "?"),
        (0, "0 bytes"),
        (812, "812 bytes"),
        (501_000, "501 kB"),
        (12_500_000, "12.5 MB"),
        (4_100_000_000, "4.1 GB"),
        (250_000_000_000, "250 GB"),
    ],
)
def test_files_and_transfers_are_sized_in_decimal_units(size: int | None, text: str) -> None:
    assert format_size(size) == text


@pytest.mark.parametrize(
    ("done", "total", "text"),
    [
        (0, 500_000, "0 of 500 kB"),
        (200_000, 500_000, "200 of 500 kB"),
        (5_000_000, 9_000_000, "5.0 of 9.0 MB"),
        (300, 800, "300 of 800 bytes"),
    ],
)
def test_progress_is_in_the_unit_of_the_total(done: int, total: int, text: str) -> None:
    assert format_progress(done, total) == text


def test_the_console_the_cli_and_a_rollout_print_sizes_through_it() -> None:
    """Each door's size words come from llmgw.units, so they cannot drift apart again."""
    from console.selectors import fetch_text, size_text

    assert size_text(501_000) == format_size(501_000)
    fetch = {"bytes_total": 500_000, "bytes_done": 200_000, "state": "fetching"}
    assert fetch_text(fetch) == format_progress(200_000, 500_000)
