"""Rebuild ``austen.txt.xz`` from Debian's ``r-cran-janeaustenr`` package.

The package stores the six novels as R character vectors (one element per printed line) in an R
lazy-load database. This script reads that database without R, joins the hard-wrapped lines into
paragraphs, drops the few editorial notes that are not Austen's, and writes one paragraph per line,
paragraphs separated by a blank line, novels in publication order. Steps (see NOTICE.md)::

    apt-get download r-cran-janeaustenr
    dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb pkg
    python build_corpus.py pkg/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb austen.txt.xz
"""

import argparse
import lzma
import re
import struct
import zlib
from pathlib import Path

# First line of each R object, in publication order (1811-1817).
TITLES = [
    "SENSE AND SENSIBILITY",
    "PRIDE AND PREJUDICE",
    "MANSFIELD PARK",
    "EMMA",
    "NORTHANGER ABBEY",
    "Persuasion",
]
STRSXP = 16


def read_rdb_records(path: Path) -> list[bytes]:
    """Each record of an R lazy-load database is a 4-byte length followed by one zlib stream."""
    data = path.read_bytes()
    records, pos = [], 0
    while pos < len(data):
        stream = zlib.decompressobj()
        records.append(stream.decompress(data[pos + 4 :]))
        pos = len(data) - len(stream.unused_data)
    return records


def parse_character_vector(blob: bytes) -> list[str]:
    """Decode an R XDR serialization (format version 3) holding one character vector."""
    if blob[:2] != b"X\n" or struct.unpack(">i", blob[2:6])[0] != 3:
        raise ValueError("expected an R XDR serialization, format version 3")
    pos = 14  # magic, format version, writer version, minimal reader version
    (encoding_len,) = struct.unpack(">i", blob[pos : pos + 4])
    pos += 4 + encoding_len
    flags, length = struct.unpack(">ii", blob[pos : pos + 8])
    pos += 8
    if flags & 0xFF != STRSXP:
        raise ValueError("expected a character vector")
    lines = []
    for _ in range(length):
        _, size = struct.unpack(">ii", blob[pos : pos + 8])
        pos += 8
        lines.append(blob[pos : pos + size].decode("utf-8") if size >= 0 else "")
        pos += max(size, 0)
    return lines


def clean_book(lines: list[str]) -> list[str]:
    """Paragraphs of one novel: wrapped lines joined, whitespace normalised, editorial notes dropped."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", "\n".join(lines)):
        text = " ".join(block.replace("_", "").split())  # underscores mark italics
        if text == "A NOTE ON THE TEXT":  # an edition's note closing Northanger Abbey
            break
        if text.startswith("[") and text.endswith("]") and "edition" in text:
            continue
        if text:
            paragraphs.append(text)
    return paragraphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rdb", type=Path, help="janeaustenr/data/Rdata.rdb from r-cran-janeaustenr")
    parser.add_argument("out", type=Path, help="output .txt.xz file")
    args = parser.parse_args()
    books = {}
    for record in read_rdb_records(args.rdb):
        lines = parse_character_vector(record)
        books[lines[0]] = lines
    paragraphs = [p for title in TITLES for p in clean_book(books[title])]
    text = "\n\n".join(paragraphs) + "\n"
    args.out.write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))


if __name__ == "__main__":
    main()
