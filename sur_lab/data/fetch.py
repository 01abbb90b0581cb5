"""Get the QA data on a machine of its own: ``sur-lab data fetch`` and ``sur-lab data status``.

:func:`fetch` downloads the four datasets' official releases, converts them to the layout the loaders read
(:mod:`sur_lab.data.layout`) and writes them, with a ``SHA256SUMS`` that pins every file, a ``SOURCES.json`` that says
where each came from, and a ``README.md``, into a cache folder (:func:`sur_lab.paths.fetched_data_dir`:
``$SUR_LAB_DATA_DIR``, else ``~/.cache/sur_lab/data/qa``). :func:`status` says which data folder the loaders use and
checks each file against its pinned checksum.

The releases (:data:`RELEASES`) and what becomes of them:

- HotpotQA, ``hotpot_dev_distractor_v1.json``: dev 100 and held-out test 500, disjoint, drawn by a fixed seed
  (original records, one per line); with ``train=True`` also a train sample of 100 from ``hotpot_train_v1.1.json``.
- 2WikiMultihopQA, ``data_ids_april7.zip`` (its ``dev.json``): dev 100, held-out test 500 (original records) and the
  filler corpus: the paragraphs of 1,000 further dev questions, each once.
- MuSiQue-Ans, ``musique_v1.0.zip``: dev 300 answerable questions (also its "test": development + final, as in the
  shared folder) and train 100 (original records).
- IIRC, ``iirc_train_dev.tgz`` and ``iirc_test.json``: every dev and test question, flattened (main passage, gold
  snippets, answer type and answers), and train 20.

The draws follow :func:`sur_lab.data.qa.select_sources`' rule (records ordered by id, then a PCG64
permutation seeded with :data:`SAMPLE_SEED`), so a fetch is reproducible, and dev, test and corpus never share a
question. The files keep the shared folder's names (the loaders' ``DATA_FILES``), but they are not the shared
folder's samples (those come from other projects' releases: IRCoT's random samples, HippoRAG's corpus, an IIRC file
with retrieved snippets), so numbers from the two folders are not comparable. The fetched IIRC questions carry no
retrieved snippets, so their distractors come from the corpus.

Verification: a release whose official SHA-256 is known (:attr:`Release.sha256`) is refused when its bytes differ; the
digest of every other release is recorded in ``SOURCES.json``. A mirror (``mirror=``, e.g. ``file:///srv/qa-mirror``
or a folder, laid out ``<mirror>/<dataset>/<release name>``) is checked against its own ``SHA256SUMS`` when it serves
one, and ``SOURCES.json`` records whether each file equals the official release. The converted files are pinned in
the folder's ``SHA256SUMS``, written last, so a fetch that did not finish leaves no folder the loaders take for a
complete one.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from sur_lab.data.layout import (CHECKSUM_FILE, CORPUS_FILE, DATA_FILES, DATASETS, HELD_OUT_FILES, checksum_text,
                                 layout_files, read_checksums, sha256_file)
from sur_lab.paths import atomic_path, data_dir_candidates, default_data_dir, fetched_data_dir

#: Seed of every draw a fetch makes (dev, test, corpus and train samples).
SAMPLE_SEED = 0
#: Record of where each release came from, written beside ``SHA256SUMS``.
SOURCES_FILE = "SOURCES.json"
#: Where releases are downloaded to, inside the destination folder (removed after a fetch unless kept).
DOWNLOADS = ".downloads"


class FetchError(RuntimeError):
    """A release could not be downloaded, did not match its checksum, or did not hold what its converter reads; the
    message names the release and its URL."""


@dataclass(frozen=True)
class Release:
    """One file of a dataset's official release.

    Attributes:
        dataset: one of :data:`sur_lab.data.layout.DATASETS`.
        name: the release's file name (also its path on a mirror: ``<mirror>/<dataset>/<name>``).
        url: the official public URL.
        sha256: the official file's SHA-256 when known (checked), else None (recorded only).
        train: True for a release only the train (prompt-example) files need; fetched with ``train=True``.
    """

    dataset: str
    name: str
    url: str
    sha256: str | None = None
    train: bool = False


RELEASES: tuple[Release, ...] = (
    Release("hotpotqa", "hotpot_dev_distractor_v1.json",
            "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json",
            "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea"),
    Release("hotpotqa", "hotpot_train_v1.1.json", "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_train_v1.1.json",
            "26650cf50234ef5fb2e664ed70bbecdfd87815e6bffc257e068efea5cf7cd316", train=True),
    # The dataset's GitHub README (Alab-NII/2wikimultihop): the version with evidences and ids.
    Release("2wikimultihopqa", "data_ids_april7.zip",
            "https://www.dropbox.com/s/ms2m13252h6xubs/data_ids_april7.zip?dl=1"),
    # StonyBrookNLP/musique's download_data.sh (a Google Drive file; confirm=t skips the large-file page).
    Release("musique", "musique_v1.0.zip",
            "https://drive.usercontent.google.com/download?id=1tGdADlNjWFaHLeZZGShh2IRcpO6Lv24h&export=download&confirm=t"),
    Release("iirc", "iirc_train_dev.tgz", "https://iirc-dataset.s3.us-west-2.amazonaws.com/iirc_train_dev.tgz"),
    Release("iirc", "iirc_test.json", "https://iirc-dataset.s3.us-west-2.amazonaws.com/iirc_test.json"),
)


@dataclass(frozen=True)
class SampleSizes:
    """How many questions a fetch draws (fewer when a release holds fewer; the README written says how many).

    Attributes:
        dev: HotpotQA and 2WikiMultihopQA development questions.
        test: their held-out questions (final evaluation only).
        corpus_questions: 2WikiMultihopQA questions whose paragraphs make the filler corpus.
        musique_dev: MuSiQue-Ans answerable development questions.
        train: HotpotQA and MuSiQue prompt examples.
        iirc_train: IIRC prompt examples.
    """

    dev: int = 100
    test: int = 500
    corpus_questions: int = 1000
    musique_dev: int = 300
    train: int = 100
    iirc_train: int = 20


# ---------------------------------------------------------------------------------------------------------------------
# Downloads


def _mirror_base(mirror: str | os.PathLike) -> str:
    text = os.fspath(mirror)
    if "://" not in text:  # a folder
        return Path(text).expanduser().resolve().as_uri()
    return text.rstrip("/")


def _open(url: str, timeout: float = 60.0):
    request = urllib.request.Request(url, headers={"User-Agent": "sur_lab-data-fetch"})
    return urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 - http(s) and file URLs by design


def _mirror_sums(base: str) -> dict[str, str]:
    """The mirror's ``SHA256SUMS`` (``<dataset>/<name>`` -> digest), empty when it serves none."""
    try:
        with _open(f"{base}/{CHECKSUM_FILE}") as response:
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError):
        return {}
    table = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and len(parts[0]) == 64:
            table[parts[1].lstrip("*")] = parts[0].lower()
    return table


def download(url: str, target: Path, *, expected_sha256: str | None = None, log: Callable[[str], Any] = print) -> str:
    """Download ``url`` (``https://``, ``http://`` or ``file://``) to ``target`` atomically and return its SHA-256.

    Raises:
        FetchError: naming the URL when the download fails, or when the bytes' SHA-256 is not ``expected_sha256``
            (nothing is left at ``target`` then).
    """
    target.parent.mkdir(parents=True, exist_ok=True)

    h = hashlib.sha256()
    size = 0
    try:
        with _open(url) as response, atomic_path(target) as tmp, tmp.open("wb") as out:
            total = response.headers.get("Content-Length")
            log(f"   downloading {url}" + (f" ({int(total) / 1e6:.1f} MB)" if total else ""))
            while block := response.read(1 << 20):
                h.update(block)
                out.write(block)
                size += len(block)
            digest = h.hexdigest()
            if expected_sha256 is not None and digest != expected_sha256:
                raise FetchError(f"{url}: SHA-256 {digest[:16]}... differs from the expected {expected_sha256[:16]}... "
                                 f"({size} bytes; a truncated download or another file): nothing was kept")
    except FetchError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise FetchError(f"{url}: download failed ({type(err).__name__}: {err}); check the network or pass a mirror "
                         "(sur-lab data fetch --mirror URL)") from err
    return digest


def _read_records(data: bytes, where: str) -> list[Any]:
    text = data.decode("utf-8")
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            return json.loads(stripped)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise FetchError(f"{where} is neither a json list nor json lines: {err}") from err


def release_records(path: Path, member: str | None = None) -> list[Any]:
    """The records of a release file (a ``.json`` list or json lines), or of the member whose base name is ``member``
    inside a ``.zip`` or ``.tgz`` release.

    Raises:
        FetchError: naming the release when the member is missing or found twice, or the data is not json.
    """
    where = f"{path.name}" + (f":{member}" if member else "")
    if member is None:
        return _read_records(path.read_bytes(), where)
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if Path(n).name == member and "__MACOSX" not in n]
            if len(names) != 1:
                raise FetchError(f"{path.name} holds {len(names)} files named {member!r}, expected one")
            return _read_records(zf.read(names[0]), where)
    try:
        with tarfile.open(path, "r:*") as tf:
            found = [m for m in tf.getmembers() if m.isfile() and Path(m.name).name == member
                     and not Path(m.name).name.startswith("._")]
            if len(found) != 1:
                raise FetchError(f"{path.name} holds {len(found)} files named {member!r}, expected one")
            return _read_records(tf.extractfile(found[0]).read(), where)
    except tarfile.TarError as err:
        raise FetchError(f"{path.name} is neither a zip nor a tar archive: {err}") from err


# ---------------------------------------------------------------------------------------------------------------------
# Conversion to the loaders' layout


def _need(rec: Any, keys: Iterable[str], where: str, i: int) -> None:
    if not isinstance(rec, Mapping):
        raise FetchError(f"{where}: record {i} is {type(rec).__name__}, not a json object")
    missing = [k for k in keys if k not in rec]
    if missing:
        raise FetchError(f"{where}: record {i} lacks {missing} (has {sorted(rec)}); not the release this converter "
                         "reads")


def draw(records: Sequence[Mapping[str, Any]], id_key: str, sizes: Sequence[int], seed: int = SAMPLE_SEED
         ) -> list[list[Mapping[str, Any]]]:
    """Disjoint seeded samples of ``records``: ordered by ``id_key``, permuted by a PCG64 generator seeded with
    ``seed``, then cut into consecutive slices of ``sizes``. When the records are fewer than the sizes add up to (a
    small mirror), every size is scaled down in proportion, keeping at least one record each while there are any.

    Raises:
        ValueError: naming ``records`` when two share an id.
    """
    ids = [str(r[id_key]) for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"records: duplicate {id_key!r} values; a draw would not be well defined")
    total = sum(sizes)
    if total > len(records):
        sizes = [max(1, n * len(records) // total) if n else 0 for n in sizes]
    ordered = [records[i] for i in sorted(range(len(records)), key=ids.__getitem__)]
    perm = np.random.default_rng(seed).permutation(len(ordered))
    out, start = [], 0
    for n in sizes:
        out.append([ordered[int(i)] for i in perm[start:start + n]])
        start += n
    return out


def _paragraphs(records: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``[{title, text}]`` of the records' context paragraphs (sentences joined), each (title, text) once."""
    seen: dict[tuple[str, str], None] = {}
    for rec in records:
        for title, sentences in rec["context"]:
            text = " ".join(s.strip() for s in sentences if s.strip())
            if text:
                seen.setdefault((str(title), text), None)
    return [{"title": t, "text": x} for t, x in seen]


_HOTPOT_KEYS = ("_id", "question", "answer", "supporting_facts", "context")


def _hotpot_like(records: list[Any], where: str) -> list[Any]:
    for i, rec in enumerate(records):
        _need(rec, _HOTPOT_KEYS, where, i)
    return records


def _iirc_flat(passages: list[Any], where: str) -> list[dict[str, Any]]:
    """IIRC's release (one record per main passage, its questions inside) as the flattened records the loaders read:
    ``id, question, answer_type, answers, answerable, main_passage, gold_question_links, gold_snippets,
    retrieved_snippets`` (empty: the release has no retrieval)."""
    out = []
    for i, passage in enumerate(passages):
        _need(passage, ("text", "questions"), where, i)
        for q in passage["questions"]:
            _need(q, ("question", "answer", "context"), where, i)
            answer = q["answer"] or {}
            kind = answer.get("type", "none")
            if kind == "span":
                answers = [str(s["text"]) for s in answer.get("answer_spans") or []]
                answer_type = "spans"
            elif kind == "value":
                answers, answer_type = [str(answer.get("answer_value", ""))], "number"
            elif kind == "binary":
                answers, answer_type = [str(answer.get("answer_value", ""))], "binary"
            else:
                answers, answer_type = [], "none"
            answers = [a for a in answers if a.strip()]
            if not answers:
                answer_type = "none"
            out.append({
                "id": str(q.get("qid") or q.get("id")),
                "question": q["question"],
                "answer_type": answer_type,
                "answers": answers,
                "answerable": answer_type != "none",
                "main_passage": passage["text"],
                "gold_question_links": list(q.get("question_links") or []),
                "gold_snippets": [{"title": str(c["passage"]), "text": c["text"]} for c in q["context"]
                                  if c.get("passage") != "main"],
                "retrieved_snippets": [],
            })
    return out


@dataclass
class _Written:
    rel: str
    records: int
    source: str


def _write(root: Path, rel: str, records: Sequence[Any], source: str, *, lines: bool) -> _Written:
    if not records:
        raise FetchError(f"{source}: no records for {rel}")
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if lines:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    else:
        text = json.dumps(list(records), ensure_ascii=False, indent=1) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return _Written(rel, len(records), source)


def _convert(dataset: str, releases: Mapping[str, Path], root: Path, sizes: SampleSizes, seed: int,
             train: bool) -> list[_Written]:
    """Write ``dataset``'s files under ``root`` from its downloaded ``releases`` (name -> path)."""
    files = DATA_FILES[dataset]
    written = []
    if dataset == "hotpotqa":
        name = "hotpot_dev_distractor_v1.json"
        dev_all = _hotpot_like(release_records(releases[name]), name)
        dev, test = draw(dev_all, "_id", [sizes.dev, sizes.test], seed)
        written += [_write(root, files["dev"], dev, name, lines=True), _write(root, files["test"], test, name, lines=True)]
        if train:
            name = "hotpot_train_v1.1.json"
            (sample,) = draw(_hotpot_like(release_records(releases[name]), name), "_id", [sizes.train], seed)
            written.append(_write(root, files["train"], sample, name, lines=False))
    elif dataset == "2wikimultihopqa":
        name = "data_ids_april7.zip"
        dev_all = _hotpot_like(release_records(releases[name], "dev.json"), f"{name}:dev.json")
        dev, test, corpus = draw(dev_all, "_id", [sizes.dev, sizes.test, sizes.corpus_questions], seed)
        written += [_write(root, files["dev"], dev, name, lines=True), _write(root, files["test"], test, name, lines=True),
                    _write(root, CORPUS_FILE, _paragraphs(corpus), name, lines=False)]
    elif dataset == "musique":
        name = "musique_v1.0.zip"
        where = f"{name}:musique_ans_v1.0_dev.jsonl"
        dev_all = release_records(releases[name], "musique_ans_v1.0_dev.jsonl")
        for i, rec in enumerate(dev_all):
            _need(rec, ("id", "paragraphs", "question", "answer"), where, i)
        (dev,) = draw([r for r in dev_all if r.get("answerable", True)], "id", [sizes.musique_dev], seed)
        written.append(_write(root, files["dev"], dev, name, lines=True))
        (sample,) = draw(release_records(releases[name], "musique_ans_v1.0_train.jsonl"), "id", [sizes.train], seed)
        written.append(_write(root, files["train"], sample, name, lines=False))
    elif dataset == "iirc":
        archive, test_name = "iirc_train_dev.tgz", "iirc_test.json"
        dev = _iirc_flat(release_records(releases[archive], "dev.json"), f"{archive}:dev.json")
        test = _iirc_flat(release_records(releases[test_name]), test_name)
        (sample,) = draw(_iirc_flat(release_records(releases[archive], "train.json"), f"{archive}:train.json"), "id",
                         [sizes.iirc_train], seed)
        written += [_write(root, files["dev"], dev, archive, lines=True),
                    _write(root, files["test"], test, test_name, lines=True),
                    _write(root, files["train"], sample, archive, lines=False)]
    else:  # pragma: no cover - guarded by fetch()
        raise ValueError(f"dataset={dataset!r} is not one of {DATASETS}")
    return written


# ---------------------------------------------------------------------------------------------------------------------
# fetch


@dataclass(frozen=True)
class FetchResult:
    """What :func:`fetch` wrote.

    Attributes:
        root: the data folder.
        files: ``{relative path: number of records}`` written by this fetch.
        sources: ``{release name: {url, sha256, pinned, official}}`` of the releases used.
    """

    root: Path
    files: dict[str, int]
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)


def _readme(written: Mapping[str, _Written], sources: Mapping[str, Mapping[str, Any]], seed: int) -> str:
    lines = ["# Multi-hop QA data fetched by `sur-lab data fetch`", "",
             "Converted from the datasets' official releases (see `SOURCES.json` for the URL and SHA-256 of each) into",
             "the layout sur_lab's loaders read; `SHA256SUMS` pins every file. The file names are those of the shared",
             "data folder, the contents are this fetch's own samples, drawn with seed "
             f"{seed} (records ordered by id, then a PCG64 permutation); dev, test and corpus share no question.",
             "Files marked held out are for final evaluation only: never choose prompts, parameters or thresholds by",
             "looking at results on them. Fetched IIRC questions carry no retrieved snippets.", "",
             "| file | records | from | held out |", "|---|---|---|---|"]
    for rel in sorted(written):
        w = written[rel]
        lines.append(f"| {rel} | {w.records} | {w.source} | {'yes' if rel in HELD_OUT_FILES else ''} |")
    lines += ["", "Releases:", ""] + [f"- `{name}` ({r['dataset']}): {r['url']}, SHA-256 `{r['sha256']}`"
                                      for name, r in sources.items()]
    lines += ["", "Licences of the underlying datasets: HotpotQA CC BY-SA 4.0; MuSiQue CC BY 4.0; 2WikiMultihopQA",
              "Apache-2.0; IIRC (AllenAI) CC BY 4.0.", ""]
    return "\n".join(lines)


def fetch(dest: Path | str | None = None, *, datasets: Sequence[str] = DATASETS, mirror: str | os.PathLike | None = None,
          train: bool = False, seed: int = SAMPLE_SEED, sizes: SampleSizes = SampleSizes(),
          keep_downloads: bool = False, releases: Sequence[Release] = RELEASES,
          log: Callable[[str], Any] = print) -> FetchResult:
    """Download the datasets' releases, convert them to the loaders' layout and verify them into ``dest``.

    Args:
        dest: the data folder (default :func:`sur_lab.paths.fetched_data_dir`: ``$SUR_LAB_DATA_DIR``, else
            ``~/.cache/sur_lab/data/qa``).
        datasets: which of :data:`sur_lab.data.layout.DATASETS` to fetch; files of the others already in ``dest``
            stay pinned.
        mirror: a base URL or folder laid out ``<mirror>/<dataset>/<release name>`` to download from instead of the
            official URLs (checked against the mirror's ``SHA256SUMS`` when it serves one).
        train: also write HotpotQA's train sample, from its 540 MB train release (prompt examples; no study reads it).
        seed: seed of every draw (:func:`draw`).
        sizes: sample sizes.
        keep_downloads: keep the release files in ``dest/.downloads`` (a later fetch reuses them when their SHA-256
            matches); by default they are removed after a fetch that finished.
        releases: the release table (default :data:`RELEASES`).
        log: called with each progress line.

    Returns:
        A :class:`FetchResult`.

    Raises:
        ValueError: naming ``datasets`` when one is not a dataset key, or ``dest`` when it is an existing file.
        FetchError: when a download fails, a checksum differs, or a release does not hold what its converter reads
            (the message names the release); ``dest``'s ``SHA256SUMS`` is then left as it was.
    """
    unknown = [d for d in datasets if d not in DATASETS]
    if unknown or not datasets:
        raise ValueError(f"datasets={list(datasets)!r}: choose one or more of {', '.join(DATASETS)}")
    root = Path(dest).expanduser().absolute() if dest is not None else fetched_data_dir()
    if root.exists() and not root.is_dir():
        raise ValueError(f"dest={str(root)!r} is an existing file; give a folder")
    root.mkdir(parents=True, exist_ok=True)
    base = _mirror_base(mirror) if mirror is not None else None
    mirror_pins = _mirror_sums(base) if base is not None else {}
    downloads = root / DOWNLOADS
    with FileLock(str(root / ".fetch.lock")):
        sums_path, sources_path = root / CHECKSUM_FILE, root / SOURCES_FILE
        pinned = read_checksums(sums_path) if sums_path.is_file() else {}
        previous = json.loads(sources_path.read_text()) if sources_path.is_file() else {}
        sources: dict[str, dict[str, Any]] = dict(previous.get("releases", {}))
        written: dict[str, _Written] = {rel: _Written(rel, n, src) for rel, (n, src) in
                                        previous.get("files", {}).items()}
        new_files: dict[str, int] = {}
        for dataset in dict.fromkeys(datasets):
            log(f"{dataset}:")
            got: dict[str, Path] = {}
            for rel in [r for r in releases if r.dataset == dataset and (train or not r.train)]:
                url = f"{base}/{dataset}/{urllib.parse.quote(rel.name)}" if base else rel.url
                expected = mirror_pins.get(f"{dataset}/{rel.name}", rel.sha256) if base else rel.sha256
                target = downloads / dataset / rel.name
                known = expected or sources.get(rel.name, {}).get("sha256")
                if target.is_file() and known and sha256_file(target) == known:
                    digest = known
                    log(f"   {rel.name}: already downloaded, SHA-256 verified")
                else:
                    digest = download(url, target, expected_sha256=expected, log=log)
                got[rel.name] = target
                sources[rel.name] = {"dataset": dataset, "url": url, "sha256": digest,
                                     "pinned": expected is not None,
                                     "official": None if rel.sha256 is None else digest == rel.sha256}
                if rel.sha256 is not None and digest != rel.sha256:
                    log(f"   note: {rel.name} from the mirror differs from the official release")
            for w in _convert(dataset, got, root, sizes, seed, train):
                pinned[w.rel] = sha256_file(root / w.rel)
                written[w.rel] = w
                new_files[w.rel] = w.records
                log(f"   {w.rel}: {w.records} records{' (held out: final evaluation only)' if w.rel in HELD_OUT_FILES else ''}")
        record = {"fetched": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seed": seed,
                  "releases": sources, "files": {r: [w.records, w.source] for r, w in sorted(written.items())}}
        with atomic_path(sources_path) as tmp:
            tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        with atomic_path(root / "README.md") as tmp:
            tmp.write_text(_readme(written, sources, seed), encoding="utf-8")
        with atomic_path(sums_path) as tmp:  # last: the folder is complete once it pins what was written
            tmp.write_text(checksum_text(pinned), encoding="utf-8")
        if not keep_downloads:
            for rel in {r for r in releases if r.dataset in datasets}:
                with contextlib.suppress(FileNotFoundError):
                    (downloads / rel.dataset / rel.name).unlink()
            for folder in sorted(downloads.glob("*"), reverse=True) + [downloads]:
                with contextlib.suppress(OSError):
                    folder.rmdir()
    log(f"{len(new_files)} files written and pinned in {sums_path}")
    return FetchResult(root, new_files, sources)


# ---------------------------------------------------------------------------------------------------------------------
# status


@dataclass(frozen=True)
class FileStatus:
    """One file of a data folder.

    Attributes:
        rel: path relative to the folder.
        role: what reads it (``"hotpotqa dev"``, ``"corpus"``; ``"other"`` for a pinned file no loader reads).
        state: ``"ok"`` (SHA-256 as pinned), ``"mismatch"``, ``"missing"`` (pinned or expected, not there),
            ``"not fetched"`` (a train file of prompt examples no study reads, neither there nor pinned),
            ``"not listed"`` (there, not in ``SHA256SUMS``) or ``"unverified"`` (the folder has no ``SHA256SUMS``).
        held_out: one of :data:`sur_lab.data.layout.HELD_OUT_FILES` (final evaluation only).
        size: bytes (None when missing).
    """

    rel: str
    role: str
    state: str
    held_out: bool
    size: int | None


@dataclass(frozen=True)
class DataStatus:
    """What :func:`status` found.

    Attributes:
        root: the data folder the loaders use (None when none was found).
        candidates: ``(folder, exists)`` in the order :func:`sur_lab.paths.default_data_dir` tries them.
        files: one :class:`FileStatus` per expected or pinned file.
        sources: the folder's ``SOURCES.json`` (a fetched folder), else ``{}``.
        error: why no folder was found, or why its checksum file could not be read ("" otherwise).
    """

    root: Path | None
    candidates: list[tuple[Path, bool]]
    files: list[FileStatus]
    sources: dict[str, Any]
    error: str = ""

    @property
    def ok(self) -> bool:
        """A folder was found, no file differs from its pin, and every dev and test file is there."""
        needed = {rel for files in DATA_FILES.values() for split, rel in files.items() if split != "train"}
        return (self.root is not None and not self.error
                and not any(f.state == "mismatch" or (f.state == "missing" and f.rel in needed) for f in self.files))


def status(root: Path | str | None = None) -> DataStatus:
    """Which data folder the loaders use, and each of its files against the folder's ``SHA256SUMS``.

    Args:
        root: a data folder to check (default: the one :func:`sur_lab.paths.default_data_dir` finds).

    Returns:
        A :class:`DataStatus`; nothing raises for a missing or damaged folder, it is reported.
    """
    candidates = [(p, p.is_dir()) for p in data_dir_candidates()]
    error = ""
    if root is None:
        try:
            root = default_data_dir()
        except FileNotFoundError as err:
            return DataStatus(None, candidates, [], {}, str(err))
    root = Path(root)
    if not root.is_dir():
        return DataStatus(None, candidates, [], {}, f"{root} is not a folder")
    sums = root / CHECKSUM_FILE
    pins: dict[str, str] = {}
    if sums.is_file():
        try:
            pins = read_checksums(sums)
        except ValueError as err:
            error = str(err)
    expected = layout_files()
    files = []
    for rel in list(expected) + sorted(set(pins) - set(expected)):
        path = root / rel
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            state = "missing"
        elif not sums.is_file():
            state = "unverified"
        elif rel not in pins:
            state = "not listed"
        else:
            state = "ok" if sha256_file(path) == pins[rel] else "mismatch"
        if state == "missing" and rel not in pins and expected.get(rel, "").endswith("train"):
            state = "not fetched"  # a prompt-example file no study reads
        files.append(FileStatus(rel, expected.get(rel, "other"), state, rel in HELD_OUT_FILES, size))
    sources = {}
    if (root / SOURCES_FILE).is_file():
        with contextlib.suppress(ValueError, OSError):
            sources = json.loads((root / SOURCES_FILE).read_text(encoding="utf-8"))
    return DataStatus(root, candidates, files, sources, error)


def status_text(st: DataStatus) -> str:
    """A plain-text report of :func:`status`: the folders tried, the one used, one line per file, the releases of a
    fetched folder."""
    buf = io.StringIO()
    buf.write("QA data folders, in the order the loaders try them:\n")
    for path, exists in st.candidates:
        mark = "used" if st.root is not None and path.resolve() == st.root.resolve() else ("found" if exists else "-")
        buf.write(f"  {mark:>5}  {path}\n")
    if st.root is None:
        buf.write(f"\nno QA data folder: {st.error}\n")
        return buf.getvalue()
    if st.root.resolve() not in {p.resolve() for p, _ in st.candidates}:
        buf.write(f"  given  {st.root}\n")
    if st.error:
        buf.write(f"\n{st.error}\n")
    buf.write(f"\n{st.root}:\n")
    width = max(len(f.rel) for f in st.files)
    for f in st.files:
        size = "" if f.size is None else f"{f.size / 1e6:8.2f} MB"
        held = "  held out: final evaluation only" if f.held_out else ""
        buf.write(f"  {f.state:>11}  {f.rel:<{width}}  {f.role:<20} {size}{held}\n")
    releases = st.sources.get("releases", {})
    if releases:
        buf.write(f"\nfetched {st.sources.get('fetched', '?')} (seed {st.sources.get('seed', '?')}) from:\n")
        for name, r in releases.items():
            check = ("official SHA-256" if r.get("official") else "mirror's SHA-256" if r.get("pinned")
                     else "SHA-256 recorded, no official pin")
            buf.write(f"  {name}: {r.get('url')} ({check})\n")
    buf.write("\n" + ("all files as pinned" if st.ok else "NOT OK: a file differs from its pin or a dev/test file is "
                      "missing; run `sur-lab data fetch`") + "\n")
    return buf.getvalue()
