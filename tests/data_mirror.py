"""A tiny local mirror of the four QA datasets' official releases, for testing ``sur-lab data fetch`` without a network.

:func:`build_mirror` writes ``<folder>/<dataset>/<release name>`` in each release's own format (HotpotQA's json list,
2WikiMultihopQA's zip with ``dev.json``, MuSiQue's zip of json lines, IIRC's tgz and test json) and the mirror's
``SHA256SUMS``. The records are made up but shaped like the releases: a question, its answer, two supporting
paragraphs and distractors, so that notebook 00 can run on them.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

CITIES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Accra", "Lima", "Riga", "Sofia", "Doha", "Perth", "Turin", "Cork",
          "Graz", "Bern", "Kyiv", "Baku", "Suva", "Male", "Apia", "Nuuk"]


def _para(title: str, n: int) -> list[str]:
    return [f"{title} is a place described in sentence {k} of its article, which mentions the river and the old "
            f"bridge built there." for k in range(n)]


def hotpot_records(n: int, prefix: str = "hp", *, wiki: bool = False) -> list[dict]:
    out = []
    for i in range(n):
        city, other = CITIES[i % len(CITIES)], CITIES[(i + 7) % len(CITIES)]
        person = f"Person {prefix}{i}"
        context = [[f"Filler {prefix}{i}a", _para(f"Filler {prefix}{i}a", 2)],
                   [person, [f"{person} was born in {city}.", f"{person} worked as an engineer."]],
                   [f"Filler {prefix}{i}b", _para(f"Filler {prefix}{i}b", 3)],
                   [city, [f"{city} is the capital of a country by the sea.", f"{city} has a large harbour."]],
                   [other, [f"{other} is far from {city}."]]]
        rec = {"_id": f"{prefix}{i:04d}", "type": "bridge", "level": "hard",
               "question": f"Which harbour city was {person} born in?", "answer": city,
               "supporting_facts": [[person, 0], [city, 0]], "context": context}
        if wiki:
            rec["evidences"] = [[person, "place of birth", city]]
        out.append(rec)
    return out


def musique_records(n: int, prefix: str) -> list[dict]:
    out = []
    for i in range(n):
        city = CITIES[i % len(CITIES)]
        paragraphs = [{"idx": k, "title": f"Title {prefix}{i}-{k}", "paragraph_text": f"Paragraph {k} about {city}.",
                       "is_supporting": k in (1, 3)} for k in range(6)]
        out.append({"id": f"2hop__{prefix}{i}", "paragraphs": paragraphs, "question": f"Where is item {i}?",
                    "question_decomposition": [], "answer": city, "answer_aliases": [city.upper()],
                    "answerable": True})
    return out


def iirc_passages(n: int, prefix: str) -> list[dict]:
    out = []
    kinds = [{"type": "span", "answer_spans": [{"text": "Geneva", "passage": "university", "type": "answer",
                                                 "start": 0, "end": 6}]},
             {"type": "value", "answer_value": "42", "answer_unit": "years"},
             {"type": "binary", "answer_value": "yes"},
             {"type": "none"}]
    for i in range(n):
        questions = [{"qid": f"q_{prefix}{i}_{j}", "question": f"Question {j} about passage {i}?",
                      "answer": kinds[(i + j) % len(kinds)], "question_links": ["university"],
                      "context": [{"text": "He studied there.", "passage": "main", "indices": [0, 17]},
                                  {"text": "The University is in Geneva.", "passage": "university",
                                   "indices": [0, 28]}]} for j in range(2)]
        out.append({"pid": f"p_{prefix}{i}", "title": f"Main {i}", "text": f"Main passage {i}. He studied there.",
                    "links": [], "questions": questions})
    return out


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _tgz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _lines(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def build_mirror(folder: Path, n: int = 24) -> Path:
    """Write a mirror of every release under ``folder`` (``n`` questions per release) with its ``SHA256SUMS``;
    return ``folder``."""
    files = {
        "hotpotqa/hotpot_dev_distractor_v1.json": json.dumps(hotpot_records(n, "hp")).encode(),
        "hotpotqa/hotpot_train_v1.1.json": json.dumps(hotpot_records(n, "ht")).encode(),
        "2wikimultihopqa/data_ids_april7.zip": _zip({
            "data_ids_april7/dev.json": json.dumps(hotpot_records(n, "wd", wiki=True)).encode(),
            "data_ids_april7/train.json": json.dumps(hotpot_records(2, "wt", wiki=True)).encode(),
            "__MACOSX/data_ids_april7/._dev.json": b"\x00\x01"}),
        "musique/musique_v1.0.zip": _zip({"data/musique_ans_v1.0_dev.jsonl": _lines(musique_records(n, "d")),
                                          "data/musique_ans_v1.0_train.jsonl": _lines(musique_records(n, "t"))}),
        "iirc/iirc_train_dev.tgz": _tgz({"iirc_train_dev/dev.json": json.dumps(iirc_passages(n // 2, "d")).encode(),
                                         "iirc_train_dev/train.json": json.dumps(iirc_passages(n // 2, "t")).encode()}),
        "iirc/iirc_test.json": json.dumps(iirc_passages(n // 2, "x")).encode(),
    }
    sums = []
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        sums.append(f"{hashlib.sha256(data).hexdigest()}  {rel}\n")
    (folder / "SHA256SUMS").write_text("".join(sums))
    return folder


if __name__ == "__main__":  # python tests/data_mirror.py FOLDER: a mirror to try `sur-lab data fetch --mirror FOLDER`
    import sys

    print(build_mirror(Path(sys.argv[1])))
