"""Set up Django for a benchmark: a fresh SQLite database in a temporary folder unless DATABASE_URL is set."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def setup(urlconf: str | None = None) -> None:
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    if "DATABASE_URL" not in os.environ:
        folder = tempfile.mkdtemp(prefix="llmgw-bench-")
        os.environ["DATABASE_URL"] = f"sqlite:///{folder}/bench.sqlite3"
        os.environ.setdefault("LLMGW_VAR_DIR", folder)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    os.environ.setdefault("LLMGW_CONFIG", "/nonexistent/server.yaml")
    import django
    from django.conf import settings

    django.setup()
    if urlconf:
        settings.ROOT_URLCONF = urlconf
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    from django.core.management import call_command
    from django.test.utils import setup_test_environment

    setup_test_environment()
    if os.environ["DATABASE_URL"].startswith("postgres"):
        # A separate database, so that a benchmark never touches real data.
        from django.test.utils import setup_databases

        setup_databases(verbosity=0, interactive=False)
    else:
        call_command("migrate", verbosity=0)
