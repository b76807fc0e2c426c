"""The Bible as text: SWORD modules from Debian, dumped with ``mod2imp`` and cleaned of markup.

Shared by the translation task (verse pairs English -> Spanish) and the language-model task
(English text). Both Bibles are public domain: ``engWEB2015eb`` (World English Bible, Debian
``sword-text-web``) and ``spaRV1909eb`` (Reina-Valera 1909, ``sword-text-sparv``); ``mod2imp``
comes with ``libsword-utils``. Dumps are cached under ``cache_dir()/sword/``.

Parsing (:func:`parse_mod2imp`, :func:`clean_osis`): blocks ``$$$Book Chapter:Verse``; chapter
or verse 0 (book and chapter introductions) are skipped; footnotes and cross references
(``<note>``), section headings (``<title>`` not marked ``canonical="true"``; the canonical psalm
superscriptions are verse text and are kept), speaker labels (Song of Solomon) and anything after
a book's end marker (the WEB glossary that follows Revelation 22:21) are dropped; the remaining
tags are stripped, spaces squeezed and the space before punctuation removed.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Dict

from .base import MissingDataError
from .common import cache_dir
from .text import atomic_write_bytes

EN_MODULE = "engWEB2015eb"  #: World English Bible (2015, with the deuterocanon)
ES_MODULE = "spaRV1909eb"   #: Reina-Valera 1909
APT_HINT = "sudo apt-get install --no-install-recommends sword-text-web sword-text-sparv libsword-utils   (or: make setup)"
PARSER_VERSION = 1  #: bump when the parsing changes, so cached parses are rebuilt

_HEADER_RE = re.compile(r"^\$\$\$(.*)$", re.M)
_VERSE_KEY_RE = re.compile(r"^(.+) (\d+):(\d+)$")
_BOOK_END_RE = re.compile(r'<div\b[^>]*\beID="[^"]*"[^>]*\btype="book"[^>]*/>')
_DROP_ELEMENT_RES = (
    re.compile(r"<note\b.*?</note>", re.S),                                   # footnotes, cross references
    re.compile(r'<title\b(?![^>]*canonical="true")[^>]*>.*?</title>', re.S),  # section headings
    re.compile(r"<speaker\b.*?</speaker>", re.S),                              # "Beloved", "Friends"
)
_TAG_RE = re.compile(r"<[^>]*>")
_SPACE_BEFORE_PUNCT_RE = re.compile(r" +(?=[.,;:!?)\]”’»])")


def clean_osis(markup: str) -> str:
    """The plain text of one verse of OSIS markup (see the module docstring for the rules)."""
    text = _BOOK_END_RE.split(markup, maxsplit=1)[0]
    for pattern in _DROP_ELEMENT_RES:
        text = pattern.sub(" ", text)  # a space: notes often sit between two words
    text = _TAG_RE.sub("", text)
    text = " ".join(text.split())
    return _SPACE_BEFORE_PUNCT_RE.sub("", text)


def parse_mod2imp(text: str) -> Dict[str, str]:
    """``{"Book C:V": verse text}`` from ``mod2imp`` output, in file order.

    Headers that are not ``Book Chapter:Verse`` (module/testament headings), chapter 0 and
    verse 0 (introductions) and verses that are empty after cleaning are skipped.
    """
    parts = _HEADER_RE.split(text)
    verses: Dict[str, str] = {}
    for key, body in zip(parts[1::2], parts[2::2]):
        key = key.strip()
        m = _VERSE_KEY_RE.match(key)
        if not m or int(m.group(2)) == 0 or int(m.group(3)) == 0:
            continue
        verse = clean_osis(body)
        if verse:
            verses[key] = verse
    return verses


def dump_module(module: str) -> str:
    """The ``mod2imp`` dump of a SWORD module (cached as ``cache_dir()/sword/MODULE.imp``)."""
    path = cache_dir("sword") / f"{module}.imp"
    if path.exists():
        return path.read_text(encoding="utf-8")
    exe = shutil.which("mod2imp")
    if exe is None:
        raise MissingDataError(f"the Bible text needs `mod2imp` and the SWORD modules: {APT_HINT}")
    proc = subprocess.run([exe, module], capture_output=True)
    out = proc.stdout.decode("utf-8", errors="replace")
    if proc.returncode != 0 or "$$$" not in out:
        detail = (proc.stderr.decode("utf-8", errors="replace") or out).strip().splitlines()[:1]
        raise MissingDataError(f"SWORD module {module} not found ({'; '.join(detail)}): {APT_HINT}")
    atomic_write_bytes(path, out.encode("utf-8"))
    return out


def read_verses(module: str) -> Dict[str, str]:
    """``{"Book C:V": text}`` of a whole module, in canonical order (cached as JSON next to the dump)."""
    path = cache_dir("sword") / f"verses_{module}_v{PARSER_VERSION}.json"
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    verses = parse_mod2imp(dump_module(module))
    atomic_write_bytes(path, json.dumps(verses, ensure_ascii=False).encode("utf-8"))
    return verses
