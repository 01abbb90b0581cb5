"""The layout of a QA data folder: dataset keys, the file of each split, the filler corpus, the held-out files and the
checksum file that pins them.

A data folder (``../shared/data/qa`` beside the repository, ``$SUR_LAB_DATA_DIR``, or the folder ``sur-lab data
fetch`` fills) holds one subfolder per dataset and a ``SHA256SUMS`` in ``sha256sum`` format (``<64 hex>  <relative
path>`` per line) that pins every file. :mod:`sur_lab.data.qa` reads it; :mod:`sur_lab.data.fetch` writes
and checks it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

DATASETS = ("hotpotqa", "2wikimultihopqa", "musique", "iirc")

# Files per dataset and split, relative to the data folder. "dev" is for development; "test" files are held out for
# final evaluation (never tune on them); "train" files are for prompts/few-shot examples only.
# HotpotQA's dev default is the IRCoT 100-question sample because the shared data README guarantees it is disjoint
# from the held-out 500; the larger hotpot_dev_distractor_sample.json shares 30 ids with that held-out file.
# MuSiQue ships one dev sample that the README marks "development + final", so its "test" is the same file.
DATA_FILES: dict[str, dict[str, str]] = {
    "hotpotqa": {
        "dev": "hotpotqa/hotpotqa__v2_dev_random_100.jsonl",
        "test": "hotpotqa/hotpotqa__v2_test_random_500.jsonl",
        "train": "hotpotqa/hotpot_train_distractor_sample100.json",
    },
    "2wikimultihopqa": {
        "dev": "2wikimultihopqa/2wikimultihopqa__v2_dev_random_100.jsonl",
        "test": "2wikimultihopqa/2wikimultihopqa__v2_test_random_500.jsonl",
    },
    "musique": {
        "dev": "musique/musique_ans_dev_sample.jsonl",
        "test": "musique/musique_ans_dev_sample.jsonl",
        "train": "musique/musique_ans_train_sample100.json",
    },
    "iirc": {
        "dev": "iirc/iirc_dev_normalized.jsonl",
        "test": "iirc/iirc_test_normalized.jsonl",
        "train": "iirc/iirc_ircot_prompt_examples_20.json",
    },
}

#: Filler paragraphs (``[{title, text}]``) for haystacks and placement fallbacks (``load_corpus``).
CORPUS_FILE = "2wikimultihopqa/hipporag_2wiki_dev1000_corpus_paragraphs.json"

#: Files the data README marks "final evaluation only" (held out). MuSiQue's dev sample is "development + final", so
#: it is not among them.
HELD_OUT_FILES = (
    "hotpotqa/hotpotqa__v2_test_random_500.jsonl",
    "2wikimultihopqa/2wikimultihopqa__v2_test_random_500.jsonl",
    "iirc/iirc_test_normalized.jsonl",
)
#: Name of the checksum file of a data folder (``sha256sum`` format: ``<64 hex>  <relative path>`` per line).
CHECKSUM_FILE = "SHA256SUMS"

_SUM_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


def layout_files() -> dict[str, str]:
    """``{relative path: role}`` of every file the loaders read, in dataset order: role ``"<dataset> <splits>"`` (one
    file may serve two splits, e.g. MuSiQue's ``"musique dev, test"``) or ``"corpus"``."""
    out: dict[str, str] = {}
    for dataset, files in DATA_FILES.items():
        splits: dict[str, list[str]] = {}
        for split, rel in files.items():
            splits.setdefault(rel, []).append(split)
        for rel, names in splits.items():
            out[rel] = f"{dataset} {', '.join(names)}"
        if CORPUS_FILE.startswith(dataset + "/"):
            out[CORPUS_FILE] = "corpus"
    return out


def sha256_file(path: Path | str) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_checksums(sums: Path | str) -> dict[str, str]:
    """``{relative path: sha256}`` from a ``sha256sum``-format file.

    Raises:
        ValueError: naming the checksum file when it is empty or a line is malformed (e.g. truncated mid-line).
    """
    sums = Path(sums)
    text = sums.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"checksum file {str(sums)!r} is empty; restore it from the data release")
    table = {}
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        m = _SUM_LINE.match(line.rstrip("\r"))
        if m is None:
            raise ValueError(f"checksum file {str(sums)!r}: line {n} is not '<sha256>  <path>' (truncated?): {line!r}")
        table[m.group(2).strip()] = m.group(1).lower()
    return table


def checksum_text(table: dict[str, str]) -> str:
    """A ``sha256sum``-format text of ``{relative path: sha256}``, sorted by path (what :func:`read_checksums`
    reads back)."""
    return "".join(f"{digest}  {rel}\n" for rel, digest in sorted(table.items()))
