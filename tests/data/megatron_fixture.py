"""Where the Megatron-Core-made fixture lives: ``shared/fixtures/megatron_format`` beside or above the repo.

A clone made elsewhere (``git clone /path/to/megalite $(mktemp -d)``) also looks beside and above the
repository it was cloned from, when that is a local directory.
"""

import os
import subprocess

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _origin() -> str | None:
    """The local directory this checkout was cloned from, if any."""
    try:
        url = subprocess.run(["git", "-C", _ROOT, "config", "--get", "remote.origin.url"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    url = url.removeprefix("file://")
    return os.path.abspath(os.path.join(_ROOT, url)) if url and os.path.isdir(os.path.join(_ROOT, url)) else None


def _find() -> str:
    starts = [_ROOT] + [origin for origin in [_origin()] if origin is not None]
    for here in starts:
        while True:
            candidate = os.path.join(here, "shared", "fixtures", "megatron_format")
            if os.path.isdir(candidate):
                return candidate
            if os.path.dirname(here) == here:
                break
            here = os.path.dirname(here)
    raise FileNotFoundError(f"no shared/fixtures/megatron_format in {' or '.join(starts)} or any directory above")


FIXTURE_DIR = _find()
FIXTURE_PREFIX = os.path.join(FIXTURE_DIR, "docs_text_document")
