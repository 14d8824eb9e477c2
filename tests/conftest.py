"""Test-wide settings.

Hypothesis runs derandomized: every run (and CI) explores the same examples, so
a failure reproduces and a green run means the same thing each time. Set
`HYPOTHESIS_PROFILE=explore` to draw fresh examples while developing.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
