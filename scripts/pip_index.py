#!/usr/bin/env python3
"""Find a file on the package indexes pip is configured for, and download it.

    python3 scripts/pip_index.py indexes                   the indexes, one a line, in the order they are tried
    python3 scripts/pip_index.py fetch PROJECT FILE OUT    FILE from PROJECT's simple page (PEP 503) to OUT;
                                                           prints the index it came from

Standard library only: scripts/setup_llama_cpp.sh runs it with whatever python it is given, which need not have
deltaserve installed. pip itself is only asked, never used to download (see that script for why).

The order is pip's own, so that a machine whose pip is pointed at a mirror through pip.conf gets the file from
the indexes it chose ("pip.conf" below: pip's active configuration, as `python -m pip config list` shows it):
  1. the main index: $PIP_INDEX_URL, else pip.conf's `install.index-url` (the command's own section, which pip
     prefers over [global]), else `global.index-url`, else pip's built-in default, read from the installed pip
     at run time (no index address is written in this repository);
  2. then the extra indexes, in their order: $PIP_EXTRA_INDEX_URL, else `install.extra-index-url`, else
     `global.extra-index-url` (whitespace-separated; as in pip, the first place that sets them wins, the
     places are not merged).
The first index whose page for PROJECT links FILE serves it; an index that lacks the page or the link, or that
cannot be reached, is passed over with a line on stderr. Credentials in an index address are masked in every
line printed.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from typing import Callable, Mapping, Optional

PAGE_TIMEOUT_S = 60
FILE_TIMEOUT_S = 600


class IndexUnavailable(Exception):
    """No index could be resolved, or none of them served the file."""


def pip_config(python: str = sys.executable) -> dict[str, str]:
    """pip's active configuration, from `python -m pip config list`: every file pip reads (global, user, site and
    $PIP_CONFIG_FILE) merged in pip's own order, keys such as `global.index-url`. Not `pip config get KEY`: that
    reads only the one file `pip config set` would write to, so it misses a mirror set machine-wide or through
    $PIP_CONFIG_FILE. Empty where pip is missing or fails."""
    try:
        r = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        key, sep, value = line.partition("=")
        if not sep:
            continue
        try:   # pip prints each value as a Python literal (repr)
            out[key.strip()] = str(ast.literal_eval(value.strip()))
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def pip_default_index() -> str:
    """The index pip uses when nothing is configured, read from the installed pip (an internal name, so a
    pip that moved it gets a clear error instead of a guess)."""
    try:
        from pip._internal.models.index import PyPI
        return PyPI.simple_url
    except (ImportError, AttributeError) as e:
        raise IndexUnavailable(f"no index configured and pip's default could not be read from {sys.executable} ({e}); "
                          "set PIP_INDEX_URL or `pip config set global.index-url ...`") from None


def resolve(env: Mapping[str, str], config: Mapping[str, str],
            default: Callable[[], str] = pip_default_index) -> list[str]:
    """The indexes in the order they are tried: the main one, then the extras (duplicates dropped). CONFIG is
    pip's active configuration (pip_config); `default` is only called where no main index is set."""
    main = (env.get("PIP_INDEX_URL") or config.get("install.index-url") or config.get("global.index-url")
            or default())
    extra = (env.get("PIP_EXTRA_INDEX_URL") or config.get("install.extra-index-url")
             or config.get("global.extra-index-url") or "")
    out: list[str] = []
    for url in [main.strip(), *extra.split()]:
        if url not in out:
            out.append(url)
    return out


def redact(url: str) -> str:
    """The address with a password in it masked, as pip prints it."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:****@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def normalize(project: str) -> str:
    """A project's name as its simple page spells it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", project).lower()


def page_url(index: str, project: str) -> str:
    """The address of PROJECT's page on INDEX. A file:// index is a directory tree whose pages are index.html
    files; pip reads a directory address the same way."""
    url = index.rstrip("/") + "/" + normalize(project) + "/"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file" and os.path.isdir(urllib.request.url2pathname(parts.path)):
        url = urllib.parse.urljoin(url, "index.html")
    return url


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def find_link(html: str, base: str, filename: str) -> Optional[str]:
    """The absolute address of the link to FILENAME on a simple page (its #sha256= fragment dropped), or None."""
    p = _Links()
    p.feed(html)
    for href in p.hrefs:
        url = urllib.parse.urljoin(base, href)
        if urllib.parse.unquote(urllib.parse.urlsplit(url).path).rsplit("/", 1)[-1] == filename:
            return urllib.parse.urldefrag(url)[0]
    return None


def fetch(indexes: list[str], project: str, filename: str, out: str, log=lambda s: None) -> str:
    """Download FILENAME to OUT from the first index that links it; the index it came from."""
    missed = []
    for index in indexes:
        page = page_url(index, project)
        try:
            with urllib.request.urlopen(page, timeout=PAGE_TIMEOUT_S) as r:
                html = r.read().decode("utf-8", "replace")
            link = find_link(html, page, filename)
            if link is None:
                raise LookupError(f"{filename} is not listed")
            with urllib.request.urlopen(link, timeout=FILE_TIMEOUT_S) as r, open(out, "wb") as f:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
            return index
        except (OSError, LookupError, ValueError) as e:   # URLError and HTTPError are OSErrors
            reason = f"{redact(index)}: {e}"
            log(f"not from {reason}")
            missed.append(reason)
    raise IndexUnavailable(f"{filename} of {project} was on none of the indexes tried: " + "; ".join(missed))


def main(argv: list[str]) -> int:
    def log(s: str) -> None:
        print(f"[pip_index] {s}", file=sys.stderr)

    try:
        if argv[:1] == ["indexes"] and len(argv) == 1:
            print("\n".join(redact(u) for u in resolve(os.environ, pip_config())))
            return 0
        if argv[:1] == ["fetch"] and len(argv) == 4:
            print(redact(fetch(resolve(os.environ, pip_config()), *argv[1:], log=log)))
            return 0
    except IndexUnavailable as e:
        log(str(e))
        return 1
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
