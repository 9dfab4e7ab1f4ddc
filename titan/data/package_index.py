"""One file of a project, fetched from the package index pip is set to use, as bytes that nothing has opened.

`pip download` cannot fetch an sdist without preparing it: it runs the sdist's setup.py or build backend, after
installing its build requirements from the same index, before a pinned hash could be compared. So the places to
look come from pip (`pip config list`: its config files and PIP_* variables, as `pip download` reads them) and
the file comes over urllib: find-links first, then index-url and extra-index-url (none with no-index), with pip's
cert, proxy and timeout, and the credentials written in a URL sent to that URL's host.
"""

from __future__ import annotations

import ast
import base64
import ssl
import subprocess
import sys
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit
from urllib.request import url2pathname

PYPI = "https://pypi.org/simple"


class DownloadError(Exception):
    """No place pip looks in has the file, or pip's settings could not be read; the message says which."""


def download(project: str, filename: str) -> tuple[str, bytes]:
    """`filename` of `project` from the first place pip would look in that has it: its URL (without credentials)
    and its bytes."""
    settings = _pip_settings()
    places = [_as_url(link) for link in settings.get("find-links", "").split()]
    if settings.get("no-index", "").lower() not in ("1", "true", "yes", "on", "y", "t"):
        indexes = [settings.get("index-url", PYPI), *settings.get("extra-index-url", "").split()]
        places += [_as_url(index).rstrip("/") + f"/{project}/" for index in indexes]
    try:
        client = _Client(settings, places)
    except OSError as e:  # ssl's error for a cert setting that names no certificate file
        raise DownloadError(f"pip's cert setting {settings.get('cert')!r}: {e}") from None
    misses = []
    for place in places:
        try:
            url = _link(client, place, filename)
            if url:
                return _public(url), client.read(url)
            misses.append(f"in {_public(place)}")
        except (OSError, ValueError) as e:  # urllib's errors are OSErrors; ValueError: a malformed URL
            misses.append(f"at {_public(place)}: {e}")
    raise DownloadError(f"no {filename} {'; '.join(misses) or 'anywhere: pip has no-index set and no find-links'}")


def _pip_settings() -> dict[str, str]:
    """pip's settings for `pip download`: its PIP_* variables over its config files' [download] over [global]."""
    result = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if result.returncode:
        why = (result.stderr.strip() or f"exit status {result.returncode}").splitlines()[-1]
        raise DownloadError(f"pip config list failed: {why}")
    found = {}
    for line in result.stdout.splitlines():  # section.name='value', the section of PIP_* variables being ":env:"
        key, equals, value = line.partition("=")
        if equals:
            section, _, name = key.rpartition(".")
            found.setdefault(section, {})[name] = ast.literal_eval(value)
    return {**found.get("global", {}), **found.get("download", {}), **found.get(":env:", {})}


def _as_url(place: str) -> str:
    """A find-links or index entry as a URL: pip takes a local path too."""
    if urlsplit(place).scheme in ("http", "https", "file"):
        return place
    return Path(place).expanduser().resolve().as_uri()


def _link(client: _Client, page: str, filename: str) -> str | None:
    """The URL of `filename` listed at `page`: a folder holding it, or an HTML page (a folder's index.html)
    linking to it; None if it is not there."""
    parts = urlsplit(page)
    folder = Path(url2pathname(parts.path)) if parts.scheme == "file" else None
    if folder and folder.is_dir():
        if (folder / filename).is_file():
            return (folder / filename).as_uri()
        if not (folder / "index.html").is_file():
            return None
        page = (folder / "index.html").as_uri()
    with client.open(page, accept="text/html") as response:
        anchors = _Anchors()
        anchors.feed(response.read().decode(response.headers.get_content_charset() or "utf-8", "replace"))
        base = response.geturl()
    for href in anchors.hrefs:
        url = urljoin(base, href).partition("#")[0]
        if unquote(urlsplit(url).path).rpartition("/")[2] == filename:
            return url
    return None


class _Anchors(HTMLParser):
    """The href of every <a> in a page."""

    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [value for name, value in attrs if name == "href" and value]


class _Client:
    """urllib with pip's cert, proxy and timeout, sending the credentials written in a place's URL
    (https://user:password@host/...) with every request to that host, and with no other."""

    def __init__(self, settings: dict[str, str], places: list[str]):
        handlers = [urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=settings.get("cert")))]
        if settings.get("proxy"):
            handlers.append(urllib.request.ProxyHandler({"http": settings["proxy"], "https": settings["proxy"]}))
        self._opener = urllib.request.build_opener(*handlers)
        self._timeout = float(settings.get("timeout") or settings.get("default-timeout") or 15)  # pip's default
        self._logins = {}
        for place in places:
            parts = urlsplit(place)
            if parts.username is not None:
                login = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
                self._logins[_host(parts)] = "Basic " + base64.b64encode(login.encode()).decode()

    def open(self, url: str, accept: str = "*/*"):
        parts = urlsplit(url)
        request = urllib.request.Request(_public(url), headers={"Accept": accept})
        if _host(parts) in self._logins:  # unredirected: a redirect to another host does not carry it
            request.add_unredirected_header("Authorization", self._logins[_host(parts)])
        return self._opener.open(request, timeout=self._timeout)

    def read(self, url: str) -> bytes:
        with self.open(url) as response:
            return response.read()


def _host(parts) -> str:
    return parts.netloc.rpartition("@")[2]


def _public(url: str) -> str:
    """The URL without the credentials in it, to request and to show."""
    parts = urlsplit(url)
    return parts._replace(netloc=_host(parts)).geturl()
