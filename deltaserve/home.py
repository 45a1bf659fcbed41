"""Where deltaserve keeps what it makes or fetches once ($DELTASERVE_HOME), and how a cache directory there is made.

Models, tokenizers, peer builds: each is a directory made atomically (`build_dir_once`), so concurrent
processes and an interrupted build never leave a half-written one in place.
"""
from __future__ import annotations

import os
import shutil
import tempfile


def home() -> str:
    return os.environ.get("DELTASERVE_HOME", os.path.join(os.path.expanduser("~"), ".cache", "deltaserve"))


def build_dir_once(path: str, fill) -> str:
    """Make the cache directory `path` atomically: fill(tmp) writes a fresh sibling directory, which is renamed
    into place, so a reader sees all of it or nothing; a process that loses a race drops its own copy."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + "-", dir=os.path.dirname(path))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users of a shared $DELTASERVE_HOME out
    try:
        fill(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
