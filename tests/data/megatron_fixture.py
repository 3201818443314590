"""Where the Megatron-Core-made fixture lives: ``shared/fixtures/megatron_format`` beside or above the repo."""

import os

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _find() -> str:
    here = _ROOT
    while True:
        candidate = os.path.join(here, "shared", "fixtures", "megatron_format")
        if os.path.isdir(candidate):
            return candidate
        if os.path.dirname(here) == here:
            raise FileNotFoundError(f"no shared/fixtures/megatron_format in {_ROOT} or any directory above it")
        here = os.path.dirname(here)


FIXTURE_DIR = _find()
FIXTURE_PREFIX = os.path.join(FIXTURE_DIR, "docs_text_document")
