"""core.logfiles when the disk is full: lines are left out whole (never cut), logging goes on
without a traceback a line, and once there is room the file says how many were left out."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from core.logfiles import SharedRotatingFileHandler
from tests.support.tmpfs import fill, mounted_tmpfs


def test_a_full_disk_leaves_lines_out_whole_and_logging_goes_on(tmp_path: Path, capfd: Any) -> None:
    with mounted_tmpfs(tmp_path / "logs", size_mb=1) as folder:
        path = folder / "web.log"
        handler = SharedRotatingFileHandler(path, max_bytes=0, backups=1)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.Logger("full-disk-test")
        logger.addHandler(handler)
        logger.warning("before")
        filler = fill(folder)
        for number in range(300):  # 31 kB: past the last page the file had room in
            logger.warning("line %03d %s", number, "x" * 90)
        left_out = handler.dropped
        assert left_out > 0

        text = path.read_text()
        assert text.endswith("\n")
        assert all(
            line == "before" or re.fullmatch(r"line \d{3} x{90}", line)
            for line in text.splitlines()
        ), "a line was cut"
        said = capfd.readouterr().err
        assert said.count(f"llmgw: cannot write to {path}: the disk is full") == 1, said
        assert "Traceback" not in said

        filler.unlink()
        logger.warning("after")
        last = path.read_text().splitlines()[-2:]
        assert last == [
            f"llmgw: {left_out} line(s) of process {os.getpid()} were left out "
            f"of {path} while its disk was full.",
            "after",
        ]
        assert handler.dropped == 0
        handler.close()
