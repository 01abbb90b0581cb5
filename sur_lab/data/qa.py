"""Multi-hop QA examples for the natural-QA study: one record type and one loader for four datasets.

The natural-QA panel (section 4.3; appendix 7.5) draws 100 source questions from each of HotpotQA, 2WikiMultiHopQA,
MuSiQue and IIRC before any model output is seen. Every source becomes a :class:`QAExample`: a question, its gold
answer(s), the supporting passages that carry the evidence, and non-supporting distractor passages. Building placement
cases (inserting a distractor before, between or after the support) is left to the code that builds prompts.

Formats read, detected from a file's content, not its name:

- **HotpotQA original** json list (``_id, question, answer, supporting_facts, context``; also 2WikiMultiHopQA's
  original files, which add ``evidences``). A passage supports iff its title appears in ``supporting_facts``; its text
  is its sentences joined.
- **IRCoT** jsonl (``question_id, question_text, answers_objects, contexts``), used by the IRCoT project's
  ``hotpotqa__v2_*`` and ``2wikimultihopqa__v2_*`` samples. Each answer object becomes one answer string (number,
  else date as "day month year", else its span).
- **IRCoT prompt examples** (``qid, question, answer, paragraphs``).
- **MuSiQue-Ans original** jsonl or json list (``paragraphs, answer, answer_aliases, answerable``). Unanswerable
  records (MuSiQue-Full) are skipped.
- **IIRC flattened** jsonl (``main_passage, gold_snippets, retrieved_snippets, answer_type, answers``); see
  :func:`_iirc_example` for which passages count as supporting.

Shipped files live under :func:`sur_lab.paths.default_data_dir` and are never copied into the repository. Files
marked "final evaluation only" in the data README are reachable only through ``split="test"`` or an explicit path
(:func:`is_held_out` tells them by file name or pinned checksum).

Validation. A file listed in a ``SHA256SUMS`` beside it (or up to two folders above, as the shipped data has) is
verified against its pinned SHA-256 before parsing, so an empty, truncated or altered shipped file is refused rather
than loaded in part; a shipped dataset key requires its file to be listed. A data folder without ``SHA256SUMS`` is read
unverified with an :class:`UnverifiedDataWarning` (once per folder and process). Every data error is a ``ValueError``
that names the file (``source=...``) and, for a bad record, its index and id: an empty file, truncated JSON, binary
garbage, a ``null`` or empty question, a ``null`` answer, a missing, ``null`` or empty id. Arguments are checked before
any file is read: ``source`` must be a path or a string, ``limit`` and ``n`` integer counts (``2.5`` is refused, not
rounded), ``seed`` a non-negative integer, ``split`` one of ``"dev"``, ``"test"``, ``"train"``.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sur_lab.checks import as_count, user_stacklevel
from sur_lab.data.layout import CHECKSUM_FILE, CORPUS_FILE, DATA_FILES, DATASETS, HELD_OUT_FILES
from sur_lab.data.layout import read_checksums as _read_checksums
from sur_lab.data.layout import sha256_file as _sha256
from sur_lab.paths import default_data_dir

# DATASETS, DATA_FILES, HELD_OUT_FILES and CHECKSUM_FILE (the layout) belong to the data layer, sur_lab.data.layout;
# they are imported here for the loaders and their callers.

# Hugging Face split names for our split names (hub path only).
_HUB_SPLITS = {"dev": "validation", "test": "test", "train": "train"}

# IIRC's own answer types; every other dataset uses "span".
IIRC_ANSWER_TYPES = ("spans", "number", "binary", "none")
# Gold answer stored for IIRC's unanswerable questions, so that every example has a non-empty answer tuple.
NONE_ANSWER = "none"
# The IIRC main passage has no title in the flattened release.
IIRC_MAIN_TITLE = ""


class UnverifiedDataWarning(UserWarning):
    """Files of the shipped data folder are read without checksum verification (its ``SHA256SUMS`` is missing)."""


def _check_source(source: Any) -> None:
    """Refuse a ``source`` that is neither a path nor a non-empty string, before any work."""
    if isinstance(source, bool) or not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"source must be a file path (str or os.PathLike), a dataset key ({', '.join(DATASETS)}) or a hub id "
            f"'owner/name[:config]'; got {type(source).__name__} {source!r}"
        )
    if isinstance(source, str) and not source.strip():
        raise ValueError(f"source={source!r} is empty; give a file path, a dataset key ({', '.join(DATASETS)}) or a "
                         "hub id 'owner/name[:config]'")


def _check_limit(limit: Any) -> int | None:
    return None if limit is None else as_count(limit, "limit", minimum=0)


@dataclass(frozen=True)
class Passage:
    """One paragraph of context.

    Attributes:
        title: article title ("" when the source gives none, e.g. IIRC's main passage).
        text: paragraph text, as released (no normalization).
        is_supporting: whether the dataset marks it as gold evidence for the question.
    """

    title: str
    text: str
    is_supporting: bool


@dataclass(frozen=True)
class QAExample:
    """One multi-hop source question with its evidence (appendix 7.5).

    Attributes:
        id: the dataset's question id.
        question: question text, stripped of surrounding whitespace.
        answers: gold answer first, then aliases (MuSiQue ``answer_aliases``; IRCoT alternative answer objects).
            IIRC is different: for ``answer_type == "spans"`` with several entries the tuple is a *bag of spans that
            are all required* (DROP's multi-span answer), not aliases; for ``"none"`` it is ``("none",)``.
        answer_type: ``"span"`` for HotpotQA, 2WikiMultiHopQA and MuSiQue; IIRC's own type for IIRC
            (``"spans"``, ``"number"``, ``"binary"`` or ``"none"``).
        supporting: gold-evidence passages in document order (never empty for shipped files).
        distractors: non-supporting passages in document order.
        dataset: one of :data:`DATASETS`.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    answer_type: str
    supporting: tuple[Passage, ...]
    distractors: tuple[Passage, ...]
    dataset: str

    @property
    def answer(self) -> str:
        """The gold answer as one string: the first answer, or an IIRC multi-span bag joined with ", "."""
        if self.dataset == "iirc" and self.answer_type == "spans" and len(self.answers) > 1:
            return ", ".join(self.answers)
        return self.answers[0]


# ---------------------------------------------------------------------------------------------------------------------
# Public entry points


def load_qa(
    source: str | Path,
    dataset: str | None = None,
    *,
    split: str = "dev",
    limit: int | None = None,
) -> list[QAExample]:
    """Load multi-hop QA examples from a file, a shipped dataset key, or the Hugging Face hub.

    ``source`` is resolved in this order:

    1. an existing file path (``.json`` list or ``.jsonl``); the format is detected from the records' fields;
    2. a dataset key in :data:`DATASETS`, resolving to ``DATA_FILES[key][split]`` under
       :func:`sur_lab.paths.default_data_dir`;
    3. a hub dataset id ``"owner/name"`` or ``"owner/name:config"`` (``"hotpotqa/hotpot_qa:distractor"``), loaded
       with ``datasets.load_dataset`` when the ``datasets`` package and a network are available. A name with no
       ``/`` that is neither a file nor a key (a misspelt key such as ``"hotpot"``) is refused at once rather than
       sent to the hub, whose retries take tens of seconds before an offline error.

    Warning:
        ``split="test"`` returns the held-out files marked "final evaluation only" in the data README. Never choose
        prompts, parameters or thresholds by looking at results on them. (MuSiQue ships a single sample that serves
        both roles, so its ``"dev"`` and ``"test"`` are the same file.)

    Args:
        source: file path, dataset key or hub dataset id (``"owner/name[:config]"``).
        dataset: dataset name to record (one of :data:`DATASETS`); inferred from the content when ``None``.
            It also selects the scorer in :func:`sur_lab.analysis.scoring.score_example`.
        split: ``"dev"`` (default), ``"test"`` (held out) or ``"train"`` (prompt examples); used for dataset keys
            and hub names, ignored for file paths.
        limit: keep only the first ``limit`` examples in file order (after skipping unanswerable MuSiQue records).

    Returns:
        Examples in file order.

    Raises:
        TypeError: naming ``source`` when it is not a ``str`` or path, ``limit`` when it is not an integer (``2.5``,
            ``True``).
        ValueError: naming ``source`` when it is empty, its format is unknown or a record is malformed (a missing,
            null or empty id included), or when it is neither an existing file, a dataset key, nor a hub id with a
            ``/`` (the message lists the keys); naming ``dataset`` when it is not one of :data:`DATASETS` or cannot
            be inferred; naming ``split`` when it is not ``"dev"``, ``"test"`` or ``"train"`` or the dataset has no
            such shipped split; naming ``limit`` when it is negative.
        FileNotFoundError: when ``source`` looks like a file path (a ``Path``, a ``.json``/``.jsonl`` suffix, an
            absolute path, or an existing directory) but is not a file, or when the data directory is missing.
        ImportError: when ``source`` is a hub id and the ``datasets`` package is not installed.
    """
    _check_source(source)
    if dataset is not None and dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r} is not one of {DATASETS}")
    if not isinstance(split, str) or split not in _HUB_SPLITS:
        raise ValueError(f"split={split!r} must be one of {', '.join(_HUB_SPLITS)}")
    limit = _check_limit(limit)
    path = Path(source)
    if path.is_file():
        records = _read_records(path)
        return _parse_records(records, source=str(path), dataset=dataset, limit=limit)
    key = str(source)
    if key in DATA_FILES:
        if dataset is not None and dataset != key:
            raise ValueError(f"dataset={dataset!r} contradicts the dataset key source={key!r}")
        files = DATA_FILES[key]
        if split not in files:
            raise ValueError(f"split={split!r}: dataset {key!r} ships only {sorted(files)}")
        root = default_data_dir()
        file = root / files[split]
        if not file.is_file():
            raise FileNotFoundError(f"shipped file for source={key!r}, split={split!r} not found: {file}")
        if not (root / CHECKSUM_FILE).exists():
            _warn_unverified(root)
        elif _checksum_entry(file) is None:
            raise ValueError(f"source={str(file)!r} is not listed in {root / CHECKSUM_FILE} (truncated checksum file?); "
                             "restore it from the data release")
        return _parse_records(_read_records(file), source=str(file), dataset=key, limit=limit)
    if isinstance(source, Path) or path.suffix in {".json", ".jsonl"} or path.is_absolute() or path.exists():
        raise FileNotFoundError(f"source={key!r} is neither an existing file nor a dataset key {DATASETS}")
    if "/" not in key.partition(":")[0]:
        raise ValueError(
            f"source={key!r} is not a dataset key (one of {', '.join(DATASETS)}), not an existing file, and not a "
            "Hugging Face hub dataset id 'owner/name[:config]' (e.g. 'hotpotqa/hotpot_qa:distractor')"
        )
    return _load_hub(key, dataset=dataset, split=split, limit=limit)


def load_example(source: str | Path, example_index: int, *, split: str = "dev") -> QAExample:
    """The example at ``example_index`` (file order) of ``source``: :func:`load_qa` reading no further than it.

    Args:
        source: as :func:`load_qa`.
        example_index: 0-based position in file order (after skipping unanswerable MuSiQue records); negative
            indexes are refused (``-1`` is not "the last one").
        split: as :func:`load_qa`.

    Raises:
        TypeError: naming ``example_index`` when it is not an integer; as :func:`load_qa`.
        ValueError: naming ``example_index`` when it is negative or past the last example (the message gives the
            number of examples); as :func:`load_qa`.
    """
    example_index = as_count(example_index, "example_index", minimum=0)
    examples = load_qa(source, split=split, limit=example_index + 1)
    if example_index >= len(examples):
        raise ValueError(f"example_index={example_index} must lie in [0, {len(examples)}): source={str(source)!r} "
                         f"holds {len(examples)} examples")
    return examples[example_index]


def select_sources(examples: Sequence[QAExample], n: int, seed: int) -> list[QAExample]:
    """Choose ``n`` source questions with a fixed seed, before any model output is seen (appendix 7.5).

    Examples are first ordered by ``(dataset, id)`` so that the choice does not depend on file order; then a numpy
    ``Generator`` (PCG64) seeded with ``seed`` permutes them and the first ``n`` are kept. Selections are therefore
    nested: the first 50 of a 100-source selection are the 50-source selection with the same seed.

    Args:
        examples: candidate pool, usually one dataset's dev examples (filter, e.g. IIRC's ``answer_type == "none"``,
            before selecting).
        n: number of sources, ``0 <= n <= len(examples)``.
        seed: generator seed (int).

    Returns:
        ``n`` examples in draw order.

    Raises:
        TypeError: naming ``n`` or ``seed`` when not an integer, ``examples`` when an item is not a
            :class:`QAExample`.
        ValueError: naming ``n`` when it is out of range, ``seed`` when negative; naming ``examples`` when two share
            a ``(dataset, id)``.
    """
    n = as_count(n, "n", minimum=0)
    seed = as_count(seed, "seed", minimum=0)
    bad = next((ex for ex in examples if not isinstance(ex, QAExample)), None)
    if bad is not None:
        raise TypeError(f"examples must be QAExample records (load_qa); got a {type(bad).__name__}")
    if not 0 <= n <= len(examples):
        raise ValueError(f"n={n!r} must lie in [0, len(examples)={len(examples)}]")
    keys = [(ex.dataset, ex.id) for ex in examples]
    if len(set(keys)) != len(keys):
        raise ValueError("examples contain duplicate (dataset, id) pairs; selection would not be well defined")
    ordered = [examples[i] for i in sorted(range(len(examples)), key=keys.__getitem__)]
    perm = np.random.default_rng(seed).permutation(len(ordered))
    return [ordered[int(i)] for i in perm[:n]]


def load_corpus(source: str | Path | None = None, *, limit: int | None = None) -> list[Passage]:
    """Load filler paragraphs (``[{title, text}]``) for haystack construction, all marked non-supporting.

    Args:
        source: a json file of ``{title, text}`` records; defaults to the shipped 2WikiMultiHopQA corpus
            (``2wikimultihopqa/hipporag_2wiki_dev1000_corpus_paragraphs.json``, 6,119 paragraphs).
        limit: keep only the first ``limit`` paragraphs.

    Returns:
        Passages in file order with ``is_supporting=False``.

    Raises:
        TypeError: naming ``source`` or ``limit`` as :func:`load_qa`.
        ValueError: naming ``source`` when a record lacks ``title`` or ``text`` (or either is null), or as
            :func:`load_qa` for an empty, corrupted or checksum-mismatched file; naming ``limit`` when negative.
    """
    if source is not None:
        _check_source(source)
    limit = _check_limit(limit)
    path = (
        Path(source)
        if source is not None
        else default_data_dir() / CORPUS_FILE
    )
    records = _read_records(path)
    out = []
    for rec in records[:limit]:
        if not isinstance(rec, Mapping) or not isinstance(rec.get("title"), str) or not isinstance(rec.get("text"), str):
            raise ValueError(f"source={str(path)!r}: corpus record {len(out)} needs text 'title' and 'text' fields "
                             "(missing or null)")
        out.append(Passage(str(rec["title"]), str(rec["text"]), False))
    return out


def is_held_out(source: str | Path) -> bool:
    """Whether ``source`` is a file the data README marks "final evaluation only".

    Decided by the file *name* (one of :data:`HELD_OUT_FILES`), or, for an existing file under another name, by its
    SHA-256 equal to a held-out file's pinned checksum. A path that merely contains "test" elsewhere (a folder, a
    dataset key, a user's own file) is not held out.
    """
    name = Path(str(source)).name
    if name in {Path(f).name for f in HELD_OUT_FILES}:
        return True
    path = Path(source)
    if not path.is_file():
        return False
    try:
        root = default_data_dir()
    except FileNotFoundError:
        return False
    sums = root / CHECKSUM_FILE
    if not sums.is_file():
        return False
    pinned = _read_checksums(sums)
    held = {pinned[f] for f in HELD_OUT_FILES if f in pinned}
    return bool(held) and _sha256(path) in held


# ---------------------------------------------------------------------------------------------------------------------
# Checksums

_VERIFIED: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> verified digest


def _checksum_entry(path: Path) -> tuple[Path, str] | None:
    """``(checksum file, pinned sha256)`` for ``path`` from the nearest ``SHA256SUMS`` in its folder or up to two
    folders above that lists it; ``None`` when none does.

    The folders are those of the path as given (made absolute, symlinks kept) first: a dataset folder reached through a
    symlink is listed relative to the data folder that links it, so it is checked against that folder's own
    ``SHA256SUMS``; then those of the resolved path (a checksum file beside the link's target)."""
    given = Path(os.path.abspath(path))
    for base in dict.fromkeys((given, path.resolve())):
        for parent in list(base.parents)[:3]:
            sums = parent / CHECKSUM_FILE
            if sums.is_file():
                pinned = _read_checksums(sums).get(base.relative_to(parent).as_posix())
                if pinned is not None:
                    return sums, pinned
    return None


_UNVERIFIED_WARNED: set[str] = set()
_UNVERIFIED_LOCK = threading.Lock()


def _warn_unverified(root: Path) -> None:
    """Warn once per data folder (and process) that its files are read without checksum verification."""
    key = str(Path(root).resolve())
    with _UNVERIFIED_LOCK:
        if key in _UNVERIFIED_WARNED:
            return
        _UNVERIFIED_WARNED.add(key)
    warnings.warn(
        f"data folder {key} has no {CHECKSUM_FILE}: its files are read unverified (an empty, truncated or altered "
        f"file is not detected); restore {CHECKSUM_FILE} from the data release",
        UnverifiedDataWarning,
        stacklevel=user_stacklevel(),
    )


def _warn_if_shipped_unverified(path: Path) -> None:
    """:func:`_warn_unverified` for a file read from the shipped data folder when that folder has no checksum file."""
    try:
        root = default_data_dir().resolve()
    except FileNotFoundError:
        return
    if path.resolve().is_relative_to(root) and not (root / CHECKSUM_FILE).exists():
        _warn_unverified(root)


def verify_checksum(path: str | Path) -> bool:
    """Verify ``path`` against its pinned SHA-256 when a ``SHA256SUMS`` lists it (see the module docstring).

    Returns:
        True when verified, False when no checksum file lists it. Results are cached per (path, size, mtime).

    Raises:
        ValueError: naming the file when its SHA-256 differs from the pinned one, or the checksum file when it is
            empty or malformed.
    """
    path = Path(path)
    entry = _checksum_entry(path)
    if entry is None:
        return False
    sums, pinned = entry
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if _VERIFIED.get(key) == pinned:
        return True
    got = _sha256(path)
    if got != pinned:
        raise ValueError(
            f"source={str(path)!r}: SHA-256 {got[:16]}... differs from {pinned[:16]}... pinned in {str(sums)!r} "
            f"({st.st_size} bytes; the file is truncated, empty or altered): restore it from the data release"
        )
    _VERIFIED[key] = pinned
    return True


# ---------------------------------------------------------------------------------------------------------------------
# Reading and format detection


def _read_records(path: Path) -> list[Any]:
    """Records of a ``.json`` list or json-lines file, after :func:`verify_checksum`.

    Raises:
        ValueError: naming the file when it is empty, not UTF-8 text (binary garbage), or not valid json / json lines
            (e.g. a truncated json list), or naming the checksum mismatch.
    """
    if not verify_checksum(path):
        _warn_if_shipped_unverified(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"source={source!r} is not UTF-8 text (binary or corrupted file): {err}") from err
    stripped = text.lstrip()
    if not stripped:
        raise ValueError(f"source={source!r} is empty: no records")
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as err:
            raise ValueError(f"source={source!r} is not a valid json list (truncated?): {err}") from err
        if not isinstance(data, list):
            raise ValueError(f"source={source!r}: expected a json list")
        return data
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"source={source!r} is neither a json list nor json lines: line {n}: {err}") from err
    return out


def _detect_format(rec: Any, source: str) -> str:
    if not isinstance(rec, Mapping):
        raise ValueError(f"source={source!r}: records are {type(rec).__name__}, not json objects")
    keys = set(rec)
    if {"question_text", "answers_objects", "contexts"} <= keys:
        return "ircot"
    if {"main_passage", "gold_snippets", "answer_type"} <= keys:
        return "iirc_flat"
    if {"paragraphs", "answer"} <= keys and ("answer_aliases" in keys or "question_decomposition" in keys):
        return "musique"
    if {"qid", "question", "answer", "paragraphs"} <= keys:
        return "ircot_prompt"
    if {"question", "answer", "supporting_facts", "context"} <= keys:
        return "hotpot"
    raise ValueError(
        f"source={source!r}: unknown QA format (first record has fields {sorted(keys)}); expected HotpotQA/2Wiki "
        "original, IRCoT jsonl, MuSiQue-Ans or flattened IIRC"
    )


def _infer_dataset(rec: Mapping[str, Any], fmt: str, source: str) -> str:
    if fmt == "musique":
        return "musique"
    if fmt == "iirc_flat":
        return "iirc"
    named = rec.get("dataset")
    if isinstance(named, str) and named.lower() in DATASETS:
        return named.lower()
    if "reasoning_steps" in rec or "evidences" in rec:
        return "2wikimultihopqa"
    name = Path(source).name.lower()
    for key in ("2wikimultihopqa", "musique", "iirc", "hotpot"):
        if key in name:
            return "hotpotqa" if key == "hotpot" else key
    if fmt == "hotpot":
        return "hotpotqa"
    raise ValueError(f"source={source!r}: cannot infer the dataset; pass dataset= one of {DATASETS}")


# Per format: (id field, question field, answer field); question must be a non-empty string and answer non-null.
_TEXT_FIELDS = {
    "hotpot": ("_id", "question", "answer"),
    "ircot": ("question_id", "question_text", "answers_objects"),
    "ircot_prompt": ("qid", "question", "answer"),
    "musique": ("id", "question", "answer"),
    "iirc_flat": ("id", "question", "answers"),
}


def _check_text_fields(rec: Any, fmt: str, source: str, i: int) -> None:
    if not isinstance(rec, Mapping):
        raise ValueError(f"source={source!r}: record {i} is {type(rec).__name__}, not a json object")
    id_key, q_key, a_key = _TEXT_FIELDS[fmt]
    rid = rec.get(id_key, rec.get("id"))
    where = f"source={source!r}: record {i} (id {rid!r})"
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or (isinstance(rid, str) and not rid.strip()):
        state = "no" if id_key not in rec and "id" not in rec else "a null, empty or non-text"
        raise ValueError(f"source={source!r}: record {i} has {state} id field {id_key!r} (got {rid!r}); every record "
                         "needs its dataset's question id")
    question = rec.get(q_key)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where} has {'a null' if question is None else 'an empty or non-text'} {q_key!r} field")
    if rec.get(a_key) is None:
        raise ValueError(f"{where} has a null {a_key!r} field")


def _parse_records(
    records: Iterable[Any], *, source: str, dataset: str | None, limit: int | None
) -> list[QAExample]:
    out: list[QAExample] = []
    fmt = name = None
    seen = 0
    for i, rec in enumerate(records):
        seen += 1
        if limit is not None and len(out) >= limit:
            break
        if fmt is None:
            fmt = _detect_format(rec, source)
            name = dataset or _infer_dataset(rec, fmt, source)
            parse = _PARSERS[fmt]
        _check_text_fields(rec, fmt, source, i)
        try:
            ex = parse(rec, name)
        except (KeyError, TypeError, IndexError, AttributeError) as err:
            rid = rec.get(_TEXT_FIELDS[fmt][0], rec.get("id"))
            raise ValueError(
                f"source={source!r}: record {i} (id {rid!r}) is not valid {fmt} ({type(err).__name__}: {err})"
            ) from err
        if ex is not None:
            if not ex.answers:
                raise ValueError(f"source={source!r}: record {i} (id {ex.id!r}) has no non-empty answer")
            out.append(ex)
    if seen == 0:
        raise ValueError(f"source={source!r} holds no records")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Per-format parsers: record -> QAExample (None to skip)


def _join_sentences(sentences: Iterable[str]) -> str:
    # HotpotQA sentences usually carry their own leading space; add one only where a sentence lacks it.
    parts: list[str] = []
    for s in sentences:
        if parts and s and not s[0].isspace() and not parts[-1][-1:].isspace():
            parts.append(" ")
        parts.append(s)
    return "".join(parts).strip()


def _split_passages(passages: Iterable[Passage]) -> tuple[tuple[Passage, ...], tuple[Passage, ...]]:
    passages = list(passages)
    return (
        tuple(p for p in passages if p.is_supporting),
        tuple(p for p in passages if not p.is_supporting),
    )


def _dedupe(strings: Iterable[str]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for s in strings:
        s = s.strip()
        if s:
            seen.setdefault(s, None)
    return tuple(seen)


def _hotpot_example(rec: Mapping[str, Any], dataset: str) -> QAExample:
    support_titles = {title for title, _ in rec["supporting_facts"]}
    passages = [
        Passage(title, _join_sentences(sentences), title in support_titles) for title, sentences in rec["context"]
    ]
    supporting, distractors = _split_passages(passages)
    return QAExample(
        id=str(rec.get("_id", rec.get("id"))),
        question=rec["question"].strip(),
        answers=_dedupe([rec["answer"]]),
        answer_type="span",
        supporting=supporting,
        distractors=distractors,
        dataset=dataset,
    )


def _answer_object_strings(obj: Mapping[str, Any]) -> list[str]:
    # Follows DROP's answer_json_to_strings: a number, else a non-empty date as "day month year", else the spans.
    number = str(obj.get("number") or "").strip()
    if number:
        return [number]
    date = obj.get("date") or {}
    date_text = " ".join(str(date.get(k) or "").strip() for k in ("day", "month", "year")).split()
    if date_text:
        return [" ".join(date_text)]
    return [str(s) for s in obj.get("spans") or []]


def _ircot_example(rec: Mapping[str, Any], dataset: str) -> QAExample:
    objects = rec["answers_objects"]
    strings = [_answer_object_strings(o) for o in objects]
    if len(objects) == 1 and len(strings[0]) > 1:
        # One answer object with several spans is DROP's multi-span answer, kept as a bag.
        answers = tuple(s.strip() for s in strings[0] if s.strip())
    else:
        answers = _dedupe(s[0] if len(s) == 1 else ", ".join(s) for s in strings if s)
    passages = [Passage(c["title"], c["paragraph_text"].strip(), bool(c["is_supporting"])) for c in rec["contexts"]]
    supporting, distractors = _split_passages(passages)
    if dataset == "iirc":
        kind = objects[0] if objects else {}
        if not answers:
            answer_type, answers = "none", (NONE_ANSWER,)
        elif str(kind.get("number") or "").strip():
            answer_type = "number"
        elif answers[0].lower() in {"yes", "no"}:
            answer_type = "binary"
        else:
            answer_type = "spans"
    else:
        answer_type = "span"
    return QAExample(
        id=str(rec["question_id"]),
        question=rec["question_text"].strip(),
        answers=answers,
        answer_type=answer_type,
        supporting=supporting,
        distractors=distractors,
        dataset=dataset,
    )


def _ircot_prompt_example(rec: Mapping[str, Any], dataset: str) -> QAExample:
    answers = _dedupe([str(rec["answer"])])
    passages = [Passage(p["title"], p["paragraph_text"].strip(), bool(p["is_supporting"])) for p in rec["paragraphs"]]
    supporting, distractors = _split_passages(passages)
    if dataset == "iirc":
        answer_type = "binary" if answers and answers[0].lower() in {"yes", "no"} else "spans"
    else:
        answer_type = "span"
    return QAExample(
        id=str(rec["qid"]),
        question=rec["question"].strip(),
        answers=answers,
        answer_type=answer_type,
        supporting=supporting,
        distractors=distractors,
        dataset=dataset,
    )


def _musique_example(rec: Mapping[str, Any], dataset: str) -> QAExample | None:
    if not rec.get("answerable", True):
        return None
    answers = _dedupe([rec["answer"], *(rec.get("answer_aliases") or [])])
    passages = [Passage(p["title"], p["paragraph_text"].strip(), bool(p["is_supporting"])) for p in rec["paragraphs"]]
    supporting, distractors = _split_passages(passages)
    return QAExample(
        id=str(rec["id"]),
        question=rec["question"].strip(),
        answers=answers,
        answer_type="span",
        supporting=supporting,
        distractors=distractors,
        dataset=dataset,
    )


def _iirc_example(rec: Mapping[str, Any], dataset: str) -> QAExample:
    """Flattened IIRC record -> QAExample.

    Supporting passages: the main passage (title ``""``) first, then every gold snippet. The main passage counts as
    evidence because IIRC questions are written against it and its links: in the shipped dev file the gold span
    answer occurs in the main passage but in no gold snippet for 58 of 593 span questions, and 12 answerable
    questions have no gold snippet at all. Distractors: retrieved snippets whose title is not a gold-snippet title
    (a linked article that holds no gold snippet is non-supporting). Unanswerable questions are kept with
    ``answer_type="none"`` and ``answers=("none",)``.
    """
    answer_type = str(rec["answer_type"])
    answerable = bool(rec.get("answerable", answer_type != "none"))
    if answer_type not in IIRC_ANSWER_TYPES:
        raise KeyError(f"answer_type {answer_type!r} not in {IIRC_ANSWER_TYPES}")
    spans = [str(a).strip() for a in rec["answers"] if str(a).strip()]
    if not answerable or answer_type == "none" or not spans:
        answer_type, answers = "none", (NONE_ANSWER,)
    else:
        # Kept with duplicates: DROP's exact match compares span counts as well as span sets.
        answers = tuple(spans)
    supporting = [Passage(IIRC_MAIN_TITLE, rec["main_passage"].strip(), True)]
    gold_titles = set()
    for g in rec["gold_snippets"]:
        supporting.append(Passage(g["title"], g["text"].strip(), True))
        gold_titles.add(g["title"])
    distractors: dict[tuple[str, str], Passage] = {}
    for r in rec.get("retrieved_snippets") or []:
        if r["title"] not in gold_titles:
            p = Passage(r["title"], r["text"].strip(), False)
            distractors.setdefault((p.title, p.text), p)
    return QAExample(
        id=str(rec["id"]),
        question=rec["question"].strip(),
        answers=answers,
        answer_type=answer_type,
        supporting=tuple(supporting),
        distractors=tuple(distractors.values()),
        dataset=dataset,
    )


_PARSERS = {
    "hotpot": _hotpot_example,
    "ircot": _ircot_example,
    "ircot_prompt": _ircot_prompt_example,
    "musique": _musique_example,
    "iirc_flat": _iirc_example,
}


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face hub


def _looks_like_hub_name(name: str) -> bool:
    repo = name.partition(":")[0]
    return bool(repo) and repo.count("/") <= 1 and " " not in repo


def _hub_row_to_record(row: Mapping[str, Any]) -> dict[str, Any]:
    """Convert the hub's columnar HotpotQA/2Wiki layout to the original one; other rows pass through."""
    rec = dict(row)
    ctx = rec.get("context")
    if isinstance(ctx, Mapping) and "title" in ctx:
        rec["context"] = [[t, list(s)] for t, s in zip(ctx["title"], ctx.get("sentences", ctx.get("content")))]
    sf = rec.get("supporting_facts")
    if isinstance(sf, Mapping) and "title" in sf:
        rec["supporting_facts"] = [[t, i] for t, i in zip(sf["title"], sf.get("sent_id", [0] * len(sf["title"])))]
    if "_id" not in rec and "id" in rec and "context" in rec:
        rec["_id"] = rec["id"]
    return rec


def _load_hub(name: str, *, dataset: str | None, split: str, limit: int | None) -> list[QAExample]:
    try:
        import datasets as hf_datasets  # optional; not a dependency of sur_lab
    except ImportError as err:
        raise ImportError(
            f"source={name!r} is not an existing file or a dataset key {DATASETS}; loading it from the Hugging Face "
            "hub needs the optional `datasets` package (pip install datasets) and a network"
        ) from err
    if split not in _HUB_SPLITS:
        raise ValueError(f"split={split!r} must be one of {sorted(_HUB_SPLITS)}")
    repo, _, config = name.partition(":")
    try:
        ds = hf_datasets.load_dataset(repo, config or None, split=_HUB_SPLITS[split])
    except Exception as err:  # network, auth and missing-repo errors all surface here
        raise RuntimeError(f"source={name!r}: could not load from the Hugging Face hub: {err}") from err
    # Lazy conversion: _parse_records stops reading once it holds `limit` examples.
    records = (_hub_row_to_record(row) for row in ds)
    return _parse_records(records, source=name, dataset=dataset, limit=limit)
