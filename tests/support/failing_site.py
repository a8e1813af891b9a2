"""Settings for a web process with one view that fails, to see how a 500 is logged."""

from llmgw_site.settings import *  # noqa: F403

ROOT_URLCONF = "tests.support.failing_urls"
