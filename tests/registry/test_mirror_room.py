"""A fetch checks the mirror's free space against its files' sizes before it starts: on a small
tmpfs (tests.support.tmpfs) a file that does not fit fails the fetch, and refuses a serve,
with the figures, before a byte is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.refusals import Refused
from registry import mirror
from registry.models import Fetch, MirrorFile
from tests.support.tmpfs import mounted_tmpfs

pytestmark = pytest.mark.django_db

BIG = {"path": "big.gguf", "size": 10 * 1024 * 1024, "sha256": "ab" * 32}


@pytest.fixture
def small_mirror(tmp_path: Path, server_yaml: Any) -> Any:
    with mounted_tmpfs(tmp_path / "mirror", size_mb=8) as folder:
        # Nothing listens on the registry's address: a fetch that went there would fail apart.
        server_yaml(
            {"registry": {"endpoint": "http://127.0.0.1:9"}, "mirror": {"root": str(folder)}}
        )
        yield folder


def test_a_fetch_that_does_not_fit_fails_before_its_first_byte(small_mirror: Path) -> None:
    fetch = Fetch.objects.create(
        repo="org/big", commit="c" * 40, files=[BIG], bytes_total=BIG["size"]
    )
    assert mirror.download(fetch.pk)
    fetch.refresh_from_db()
    assert fetch.state == Fetch.FAILED
    assert fetch.message == (
        "not enough disk space for big.gguf: they take 10.00 MB and the mirror's disk has "
        f"8.00 MB free ({small_mirror}, of 8.00 MB), 64.00 MB of which is kept for the database "
        "and the logs; nothing was fetched"
    )
    assert list(small_mirror.iterdir()) == []


def test_a_serve_that_does_not_fit_is_refused_with_the_figures(small_mirror: Path) -> None:
    with pytest.raises(Refused) as refused:
        mirror.refuse_past_mirror_room("serve org/big", "org/big", [BIG])
    assert (refused.value.status, refused.value.code) == (507, "disk_full")
    assert refused.value.message == (
        "Cannot serve org/big: not enough disk space for big.gguf: they take 10.00 MB and the "
        f"mirror's disk has 8.00 MB free ({small_mirror}, of 8.00 MB), 64.00 MB of which is "
        "kept for the database and the logs. Nothing was fetched. Free space there (models no "
        "longer served: `llmgw ctl model remove NAME`, after which the mirror deletes the files "
        "nothing else uses), then try again."
    )


def test_a_file_the_mirror_holds_already_takes_no_room(small_mirror: Path) -> None:
    MirrorFile.objects.create(
        repo="org/big", commit="d" * 40, path="big.gguf", sha256=BIG["sha256"], size=BIG["size"]
    )
    mirror.refuse_past_mirror_room("serve org/big", "org/big", [BIG])  # linked: no refusal
