"""Reading the documentation and the code the way tests/test_docs.py compares them: the
environment variables the code reads, the names a page documents, a page's tables, links,
headings (as GitHub makes anchors of them) and the blocks marked runnable."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Folders that are not the product: what they read is documented apart, or not at all.
NOT_PRODUCT = {"tests", "bench"}
SKIPPED = {".venv", "var", ".git", "node_modules", "__pycache__"}

# A variable is read by its name as a string literal: os.environ.get("X"), env_int("X", …),
# getattr(settings, "X", …) for the settings that mirror one.
READ = re.compile(r"""["']((?:LLMGW|OTEL)_[A-Z0-9_]*[A-Z0-9]|DATABASE_URL|REDIS_URL)["']""")
NAME = re.compile(r"\b(?:LLMGW|OTEL)_[A-Z0-9_]*[A-Z0-9]\b|\bDATABASE_URL\b|\bREDIS_URL\b")


def python_files(*, everywhere: bool = False) -> list[Path]:
    files = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if SKIPPED & set(parts):
            continue
        if not everywhere and parts[0] in NOT_PRODUCT:
            continue
        files.append(path)
    return files


# In the Makefile and scripts/: $NAME or ${NAME…}.
SHELL_READ = re.compile(r"\$\{?(LLMGW_[A-Z0-9_]*[A-Z0-9])")


def shell_files() -> list[Path]:
    return [ROOT / "Makefile", *sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())]


def read_names(*, everywhere: bool = False) -> dict[str, str]:
    """Each variable name the code reads, with one file that reads it: the Python outside
    tests/ and bench/, the Makefile and scripts/. `everywhere` includes the tests and
    benchmarks, and any mention of the name (a documented name must at least be mentioned
    somewhere)."""
    found: dict[str, str] = {}
    pattern = NAME if everywhere else READ
    for path in python_files(everywhere=everywhere):
        for name in pattern.findall(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    for path in shell_files():
        shell_pattern = NAME if everywhere else SHELL_READ
        for name in shell_pattern.findall(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def documented_names(text: str, *, ours: bool = False) -> set[str]:
    """The variable names a page mentions; `ours` leaves out the OTEL_ names that only
    OpenTelemetry's SDK reads (mentioned, but not ours to find in the code)."""
    return {name for name in NAME.findall(text) if not (ours and name.startswith("OTEL_"))}


def outside_code(text: str) -> str:
    """The page without its fenced blocks and inline code."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def table_rows(text: str) -> list[list[str]]:
    """Every row of every table, as its cells (separator rows left out)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|") or re.fullmatch(r"\|[\s|:-]+\|", line):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip("|"))]
        rows.append(cells)
    return rows


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(text: str) -> list[str]:
    """The page's relative link targets (web addresses and mail left out)."""
    return [
        target
        for target in LINK.findall(outside_code(text))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
    for match in re.finditer(r"(?m)^#{1,6} +(.+?) *#*$", text):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


RUNNABLE = re.compile(r"(?ms)^<!-- runnable -->\n```(sh|python)\n(.*?)^```")


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block right after a `<!-- runnable -->` line."""
    return [(language, body.rstrip("\n")) for language, body in RUNNABLE.findall(text)]
