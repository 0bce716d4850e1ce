"""Readers for the installed text sources: Debian's fortune cookies and Python's documentation sources.

Each reader returns a list of plain-text documents (str). Nothing is downloaded: both sources come from
Debian packages (`fortunes`, `fortunes-min`, `python3-doc`); a missing package raises an error that says
which one to install.
"""

from __future__ import annotations

import re
from pathlib import Path

from recipe import FORTUNE_FILES_EXCLUDED, FORTUNES_DIR, PYTHON_DOC_SOURCES_DIR


class MissingSourceError(FileNotFoundError):
    """A text source is not installed; the message names the Debian package."""


def read_fortunes(max_chars: int = 1200) -> dict[str, list[str]]:
    """{category: [fortune, ...]} from the UTF-8 fortune files, one fortune per '%'-separated record."""
    files = sorted(FORTUNES_DIR.glob("*.u8")) if FORTUNES_DIR.is_dir() else []
    if not files:
        raise MissingSourceError(f"no *.u8 files in {FORTUNES_DIR}: apt-get install fortunes fortunes-min")
    categories: dict[str, list[str]] = {}
    for path in files:
        category = path.name[: -len(".u8")]
        if category in FORTUNE_FILES_EXCLUDED:
            continue
        records = path.read_text(encoding="utf-8", errors="replace").split("\n%\n")
        cleaned = [_clean_fortune(record) for record in records]
        categories[category] = [text for text in cleaned if 20 <= len(text) <= max_chars]
    return categories


def _clean_fortune(record: str) -> str:
    lines = [line.replace("\t", "    ").rstrip() for line in record.strip("%\n").split("\n")]
    return "\n".join(lines).strip()


def read_python_docs(chunk_chars: int = 3000) -> list[str]:
    """Python's reStructuredText documentation, markup stripped, cut at paragraph ends into chunks."""
    files = sorted(PYTHON_DOC_SOURCES_DIR.rglob("*.rst.txt")) if PYTHON_DOC_SOURCES_DIR.is_dir() else []
    if not files:
        raise MissingSourceError(f"no *.rst.txt under {PYTHON_DOC_SOURCES_DIR}: apt-get install python3-doc")
    documents: list[str] = []
    for path in files:
        if "whatsnew" in path.parts or path.name in ("license.rst.txt", "copyright.rst.txt"):
            continue  # change logs and legal text: lists of names and numbers, not prose
        text = strip_rst(path.read_text(encoding="utf-8", errors="replace"))
        documents.extend(_chunk_paragraphs(text, chunk_chars))
    return [doc for doc in documents if len(doc) >= 200]


_ROLE = re.compile(r":[a-zA-Z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")  # :func:`~os.path.join` -> os.path.join
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")  # `text <url>`_ -> text
_LITERAL = re.compile(r"``([^`]+)``")
_TARGET = re.compile(r"`([^`]+)`_+")
_STRONG = re.compile(r"\*\*([^*]+)\*\*")
_UNDERLINE = re.compile(r"^([=\-~^*#+\"'`.:_])\1{2,}\s*$")


def strip_rst(text: str) -> str:
    """Drop directives, comments, section underlines and field lists; unwrap roles and literals."""
    kept: list[str] = []
    skipping_directive = False
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith(".. "):
            skipping_directive = not re.match(r"\.\. (code-block|doctest|testcode|note|warning|seealso)", stripped)
            continue
        if skipping_directive:
            if stripped and not line.startswith((" ", "\t")):
                skipping_directive = False
            else:
                continue
        if _UNDERLINE.match(line) or (stripped.startswith(":") and stripped.count(":") >= 2 and " " not in stripped[:20]):
            continue
        line = _ROLE.sub(lambda m: m.group(1).split(".")[-1] if m.group(0).startswith(":") and "~" in m.group(0) else m.group(1), line)
        line = _LINK.sub(r"\1", line)
        line = _LITERAL.sub(r"\1", line)
        line = _TARGET.sub(r"\1", line)
        line = _STRONG.sub(r"\1", line)
        kept.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


def _chunk_paragraphs(text: str, chunk_chars: int) -> list[str]:
    chunks, current = [], ""
    for paragraph in text.split("\n\n"):
        if current and len(current) + len(paragraph) > chunk_chars:
            chunks.append(current.strip())
            current = ""
        current += paragraph + "\n\n"
    if current.strip():
        chunks.append(current.strip())
    return chunks
