"""Natural multi-hop QA's placement cases (section 4.3; appendix 7.5): sources, their passages, the placement edits,
Table 20's fixed inputs, the sweep cases and timed subset, and the runnable methods.

Construction (section 4.3; appendix 7.5). Each *source* question supplies one non-supporting passage ``X`` that is
inserted before, between or after the supporting evidence of an otherwise fixed *clean document*; deleting ``X``
restores that clean document token for token, so the three placement cases of a source share the clean prompt, the
query and the gold answer and differ only in where the stale suffix starts. Placements are paired by source and are
not independent questions (appendix 8.3).

Choices the paper leaves open, fixed here (all before any model output; :class:`~sur_lab.data.text.PanelConfig` holds them):

- **Clean document** = ``lead`` framing passages, the supporting passages in the dataset's order, ``tail`` framing
  passages. Framing passages are non-supporting passages of the same source (its own distractors), so the
  document stays natural text. With ``tail = 0`` the after-support placement would delete the document's last
  passage and leave an empty suffix (S = 0: every method equals Re-prefill trivially), hence the default ``tail = 1``.
- **Between** = after the first ``k // 2`` of the ``k`` supporting passages; sources need ``k >= 2`` (IIRC questions
  whose only evidence is the main passage are not eligible; that filter uses annotations only).
- **Inserted and framing passages**: drawn from the source's own distractors with a per-source generator seeded by
  ``(seed, crc32("dataset/id"))``; when the source has too few (61 % of IIRC dev questions have no retrieved
  non-gold snippet), the rest come from :func:`sur_lab.data.qa.load_corpus` (2WikiMultiHopQA Wikipedia paragraphs)
  with the same generator. A candidate is rejected when it shares a title with a supporting passage, repeats a chosen
  passage, or contains a normalized gold answer as a whole-word substring (span and number answers; yes/no and
  "none" answers are not checked), as appendix 10.1 rejects documents with an answer alias or support title.
- **IIRC unanswerable questions** (``answer_type == "none"``) are excluded by default
  (``include_unanswerable=False``): the construction places an insertion relative to evidence that supports the
  answer, and IIRC's gold snippets of unanswerable questions by definition do not. Set the flag to include them; the
  scorer handles their ``"none"`` answers.
- **Prompt**: the model's native chat template through :func:`sur_lab.edits.chat_edit` and
  :func:`sur_lab.edits.format_passages`; the query (question and template tail) follows the documents. Reasoning
  mode is whatever the template does by default: none for the embedded SmolLM2; a Qwen3 template would need
  ``enable_thinking=False``, which :func:`sur_lab.edits.render_chat` does not pass.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sur_lab.allocators import ALLOCATORS
from sur_lab.analysis.scoring import normalize_answer
from sur_lab.data.qa import (
    DATASETS,
    Passage,
    QAExample,
    load_corpus,
    load_qa,
    select_sources,
)
from sur_lab.data.text import PanelConfig, is_eligible, source_rng
from sur_lab.edits import (
    DEFAULT_INSTRUCTION,
    EditedContext,
    chat_edit,
    chat_prompt_ids,
    format_passages,
)
from sur_lab.sweeps import Case

#: Placement of the inserted passage relative to the supporting evidence (section 4.3).
PLACEMENTS = ("before", "between", "after")
#: Allocators of the natural-QA comparison (section 4.3, Tables 7-11), by their registered names.
PAPER_ALLOCATORS = ("SUR", "BM25 (same units)", "CacheBlend-Adapted", "InfoFlow-Motivated", "ProphetKV-Adapted")
#: Reference operators of the comparison, in table order.
REFERENCES = ("Shift", "Replay", "Re-prefill")
#: Column headings of Tables 10-11.
DATASET_LABELS = {"2wikimultihopqa": "2Wiki", "hotpotqa": "HotpotQA", "iirc": "IIRC", "musique": "MuSiQue"}

# Answer types whose gold strings are checked against candidate passages: a yes/no or "none" gold says nothing
# about whether a passage leaks the answer.
_LEAK_CHECKED_TYPES = frozenset({"span", "spans", "number"})


@dataclass(frozen=True)
class Source:
    """One source question with the passages its three placement cases use.

    Attributes:
        example: the QA example.
        inserted: the non-supporting passage inserted and then deleted (same for all three placements).
        lead / tail: framing non-supporting passages before / after the evidence in the clean document.
        origins: where ``inserted``, the lead and the tail passages came from, in that order: ``"native"`` (the
            source's own distractors) or ``"corpus"`` (:func:`sur_lab.data.qa.load_corpus`).
    """

    example: QAExample
    inserted: Passage
    lead: tuple[Passage, ...]
    tail: tuple[Passage, ...]
    origins: tuple[str, ...]

    @property
    def clean_passages(self) -> tuple[Passage, ...]:
        """The clean document: lead, supporting passages, tail."""
        return (*self.lead, *self.example.supporting, *self.tail)

    def insert_index(self, placement: str) -> int:
        """Index of the inserted passage in the placement's passage list (before / between / after the evidence).

        Raises:
            ValueError: naming ``placement`` when it is not one of :data:`PLACEMENTS`.
        """
        k = len(self.example.supporting)
        offsets = {"before": 0, "between": k // 2, "after": k}
        if placement not in offsets:
            raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
        return len(self.lead) + offsets[placement]

    def passages(self, placement: str) -> tuple[Passage, ...]:
        """The document of one placement case: the clean document with ``inserted`` at :meth:`insert_index`."""
        i = self.insert_index(placement)
        clean = self.clean_passages
        return (*clean[:i], self.inserted, *clean[i:])


@dataclass(frozen=True)
class PlacementCase:
    """One placement case: an edit that deletes the inserted passage, plus what scoring and tables need.

    Attributes:
        case_id: ``"{dataset}/{source_id}/{placement}"``.
        source: the source (example and passages).
        placement: one of :data:`PLACEMENTS`.
        edit: the edit (``original_ids`` = prompt with the inserted passage, ``edited_ids`` = clean prompt).
    """

    case_id: str
    source: Source
    placement: str
    edit: EditedContext = field(repr=False, compare=False)

    @property
    def example(self) -> QAExample:
        return self.source.example

    @property
    def meta(self) -> dict[str, Any]:
        """Flat scalars copied into every sweep record (the sweep itself records p, d, S and the gold answers)."""
        return {
            "dataset": self.example.dataset,
            "source_id": self.example.id,
            "placement": self.placement,
            "answer_type": self.example.answer_type,
            "inserted_title": self.source.inserted.title,
            "inserted_origin": self.source.origins[0],
            "query_len": int(self.edit.query_ids.numel()),
        }


# ---------------------------------------------------------------------------------------------------------------------
# Sources


def select_panel(
    datasets: Sequence[str] = DATASETS,
    n_per_dataset: int = 100,
    config: PanelConfig = PanelConfig(),
    *,
    split: str = "dev",
    corpus: Sequence[Passage] | None = None,
) -> list[Source]:
    """Choose ``n_per_dataset`` eligible sources per dataset by ``config.seed`` and draw their passages (app. 7.5).

    Selection uses only the dataset files: eligible examples (:func:`~sur_lab.data.text.is_eligible`) of each dataset's shipped file for
    ``split`` are drawn with :func:`sur_lab.data.qa.select_sources` (nested: the first n of a larger panel are the
    smaller panel), then :func:`choose_passages` fixes each source's inserted and framing passages.

    Args:
        datasets: dataset keys (subset of :data:`sur_lab.data.qa.DATASETS`), in output order.
        n_per_dataset: sources per dataset (paper: 100), >= 1 and at most the eligible pool.
        config: panel configuration.
        split: ``"dev"`` (development files, the default). ``"test"`` reads the held-out files: never tune on them.
        corpus: fallback passages (default :func:`sur_lab.data.qa.load_corpus`, loaded only when needed).

    Returns:
        Sources grouped by dataset in ``datasets`` order, draw order within a dataset.

    Raises:
        ValueError: naming ``datasets`` for an unknown or repeated key, ``n_per_dataset`` when out of range for a
            dataset's eligible pool.
    """
    unknown = [d for d in datasets if d not in DATASETS]
    if unknown or len(set(datasets)) != len(datasets):
        raise ValueError(f"datasets={list(datasets)!r} must be distinct keys of {DATASETS}")
    if int(n_per_dataset) != n_per_dataset or n_per_dataset < 1:
        raise ValueError(f"n_per_dataset={n_per_dataset!r} must be an integer >= 1")
    sources = []
    for name in datasets:
        pool = [ex for ex in load_qa(name, split=split) if is_eligible(ex, config)]
        if n_per_dataset > len(pool):
            raise ValueError(f"n_per_dataset={n_per_dataset} exceeds the {len(pool)} eligible {name} sources")
        for ex in select_sources(pool, n_per_dataset, config.seed):
            sources.append(choose_passages(ex, config, corpus=corpus))
    return sources


@functools.lru_cache(maxsize=1)
def _default_corpus() -> tuple[Passage, ...]:
    return tuple(load_corpus())


def _answer_needles(example: QAExample) -> list[str]:
    if example.answer_type not in _LEAK_CHECKED_TYPES:
        return []
    needles = {normalize_answer(a) for a in example.answers}
    return [n for n in needles if n]


def passage_admissible(passage: Passage, example: QAExample) -> bool:
    """Whether ``passage`` may be inserted into or frame ``example``'s document (module docstring).

    Rejects supporting passages, passages titled like a supporting passage, empty passages, and passages whose
    :func:`sur_lab.analysis.scoring.normalize_answer` text contains a normalized gold answer as whole words (span and number
    answers only).
    """
    if passage.is_supporting or not passage.text.strip():
        return False
    if passage.title in {p.title for p in example.supporting}:
        return False
    text = f" {normalize_answer(passage.text)} "
    return not any(f" {needle} " in text for needle in _answer_needles(example))


def choose_passages(
    example: QAExample, config: PanelConfig = PanelConfig(), *, corpus: Sequence[Passage] | None = None
) -> Source:
    """Draw the inserted passage and the framing passages of one source (module docstring).

    The source's admissible distractors (:func:`passage_admissible`) are permuted by :func:`~sur_lab.data.text.source_rng`; the first is
    the inserted passage, the next ``lead`` and then ``tail`` frame the evidence. Missing ones are drawn uniformly
    from ``corpus`` by the same generator, skipping inadmissible passages and repeats (same title or text).

    Args:
        example: an eligible example (:func:`~sur_lab.data.text.is_eligible`).
        config: panel configuration (``lead``, ``tail``, ``seed``).
        corpus: fallback passages (default :func:`sur_lab.data.qa.load_corpus`).

    Returns:
        The :class:`Source`.

    Raises:
        ValueError: naming ``example`` when it is not eligible, or ``corpus`` when it cannot supply enough admissible
            passages.
    """
    if len(example.supporting) < config.min_supporting:
        raise ValueError(
            f"example {example.dataset}/{example.id} has {len(example.supporting)} supporting passages; "
            f"placements need >= {config.min_supporting}"
        )
    rng = source_rng(example, config.seed)
    needed = 1 + config.lead + config.tail
    native = [p for p in example.distractors if passage_admissible(p, example)]
    chosen: list[Passage] = []
    origins: list[str] = []
    seen_titles: set[str] = set()
    seen_texts: set[str] = set()

    def take(p: Passage, origin: str) -> None:
        chosen.append(p)
        origins.append(origin)
        seen_titles.add(p.title)
        seen_texts.add(p.text.strip())

    for i in rng.permutation(len(native)):
        p = native[int(i)]
        if len(chosen) == needed:
            break
        if p.text.strip() not in seen_texts:
            take(p, "native")
    if len(chosen) < needed:
        pool = corpus if corpus is not None else _default_corpus()
        attempts = 0
        while len(chosen) < needed:
            attempts += 1
            if attempts > 50 * needed + len(pool):
                raise ValueError(
                    f"corpus cannot supply {needed} admissible passages for {example.dataset}/{example.id}"
                )
            p = pool[int(rng.integers(len(pool)))]
            if p.title in seen_titles or p.text.strip() in seen_texts or not passage_admissible(p, example):
                continue
            take(p, "corpus")
    inserted, rest = chosen[0], chosen[1:]
    return Source(
        example=example,
        inserted=inserted,
        lead=tuple(rest[: config.lead]),
        tail=tuple(rest[config.lead :]),
        origins=tuple(origins),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Placement cases


def clean_prompt_ids(tokenizer, source: Source, *, instruction: str = DEFAULT_INSTRUCTION) -> torch.Tensor:
    """``[p + S + Q]`` int64: the clean prompt (clean document, question, template tail) tokenized by segments (head,
    one per passage, query) as :func:`sur_lab.edits.chat_prompt_ids` does."""
    documents, _ = format_passages(source.clean_passages)
    return chat_prompt_ids(tokenizer, documents, source.example.question, instruction=instruction)


def build_case(
    tokenizer, source: Source, placement: str, *, instruction: str = DEFAULT_INSTRUCTION
) -> PlacementCase:
    """Build the placement case that inserts ``source.inserted`` at ``placement`` and deletes it (section 4.3).

    The edit deletes the inserted passage's character span (with its blank-line separator) from the rendered chat
    prompt; the result is checked at token level: the edited tokens followed by the query tokens must equal the clean
    prompt tokenized on its own (:func:`clean_prompt_ids`).

    Args:
        tokenizer: the model's fast tokenizer with a chat template.
        source: the source.
        placement: one of :data:`PLACEMENTS`.
        instruction: text before the documents.

    Returns:
        The :class:`PlacementCase`.

    Raises:
        ValueError: naming ``placement`` when unknown; as :func:`sur_lab.edits.chat_edit` for spans that cannot be cut
            at token boundaries.
        RuntimeError: if deleting the passage does not restore the clean prompt token for token.
    """
    index = source.insert_index(placement)
    documents, spans = format_passages(source.passages(placement))
    edit = chat_edit(tokenizer, documents, source.example.question, spans[index], instruction=instruction)
    clean = clean_prompt_ids(tokenizer, source, instruction=instruction)
    restored = torch.cat((edit.edited_ids, edit.query_ids))
    if not torch.equal(restored, clean):
        raise RuntimeError(
            f"deleting the inserted passage of {source.example.dataset}/{source.example.id} ({placement}) does not "
            "restore the clean prompt's tokens"
        )
    case_id = f"{source.example.dataset}/{source.example.id}/{placement}"
    return PlacementCase(case_id, source, placement, edit)


def build_cases(
    tokenizer,
    sources: Iterable[Source],
    placements: Sequence[str] = PLACEMENTS,
    *,
    instruction: str = DEFAULT_INSTRUCTION,
) -> list[PlacementCase]:
    """All placement cases of ``sources``, source-major (the placements of a source are adjacent).

    Raises:
        ValueError: naming ``placements`` when empty, repeated or not in :data:`PLACEMENTS`.
    """
    if not placements or len(set(placements)) != len(placements) or not set(placements) <= set(PLACEMENTS):
        raise ValueError(f"placements={list(placements)!r} must be distinct values of {PLACEMENTS}")
    return [build_case(tokenizer, s, p, instruction=instruction) for s in sources for p in placements]


# ---------------------------------------------------------------------------------------------------------------------
# Sweep glue (the shared runner is sur_lab.sweeps.run_sweep)


#: The QA datasets of Table 20's four inputs, in table order.
QA_DATASETS = ("2wikimultihopqa", "hotpotqa", "iirc", "musique")


def qa_inputs(tokenizer, datasets: Sequence[str] = QA_DATASETS, *, placement: str = "before") -> list:
    """Table 20's fixed inputs (appendix 13.4): per dataset, the lexicographically first source id among the eligible
    development examples and its ``placement`` case (this study's construction, :func:`build_case`), chosen from the
    files alone, independently of any output. Notebook 04 times recovery on them.

    Returns:
        :class:`PlacementCase` objects, one per dataset, in ``datasets`` order.

    Raises:
        ValueError: naming ``datasets`` (unknown or repeated) or ``placement`` (not a placement).
    """
    if not datasets or len(set(datasets)) != len(datasets) or not set(datasets) <= set(DATASETS):
        raise ValueError(f"datasets={list(datasets)!r} must be distinct keys of {DATASETS}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    config = PanelConfig()
    out = []
    for name in datasets:
        pool = [ex for ex in load_qa(name, split="dev") if is_eligible(ex, config)]
        first = min(pool, key=lambda ex: str(ex.id))
        out.append(build_case(tokenizer, choose_passages(first, config), placement, instruction=config.instruction))
    return out


def trial_case_id(case_id: str, trial: int) -> str:
    """Sweep case id of a repeated timing trial: the case id itself for trial 0, ``"{case_id}#t{trial}"`` after."""
    return case_id if trial == 0 else f"{case_id}#t{trial}"


def sweep_cases(cases: Sequence[PlacementCase], trials: int = 1) -> list:
    """Placement cases as :class:`sur_lab.sweeps.Case` objects, ``trials`` timed trials per case.

    Trial t > 0 of a case is a separate sweep case (:func:`trial_case_id`) with the same edit, so each trial is
    timed once and resumes independently; trials are ordered trial-major (every case once, then again), so that
    slow drifts of a shared machine do not load one case's trials. ``meta`` carries :attr:`PlacementCase.meta` plus
    ``trial``; ``gold`` is the example's answers.

    Args:
        cases: placement cases.
        trials: timed trials per case, >= 1 (the paper: 1).

    Returns:
        ``len(cases) * trials`` sweep cases.

    Raises:
        ValueError: naming ``trials`` when it is not an integer >= 1.
    """
    if int(trials) != trials or trials < 1:
        raise ValueError(f"trials={trials!r} must be an integer >= 1")
    return [
        Case(trial_case_id(c.case_id, t), c.edit, gold=tuple(c.example.answers), meta={**c.meta, "trial": t})
        for t in range(int(trials))
        for c in cases
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Methods


def available_methods(
    allocators: Sequence[str] = PAPER_ALLOCATORS, references: Sequence[str] = REFERENCES
) -> tuple[list[str], list[str]]:
    """Split the requested methods into those that can run now and the allocators not registered yet.

    Reference operators always run; an allocator runs when :data:`sur_lab.allocators.ALLOCATORS` holds its name.

    Returns:
        ``(methods, missing)``: runnable methods (allocators first, in the given order, then references) and the
        unregistered allocator names.
    """
    runnable = [m for m in allocators if m in ALLOCATORS]
    missing = [m for m in allocators if m not in ALLOCATORS]
    return runnable + [r for r in references if r not in runnable], missing

# ---------------------------------------------------------------------------------------------------------------------
# Timed cases


def timed_case_ids(placement: Sequence[PlacementCase], timed_sources: int, trials: int = 1) -> list[str]:
    """The sweep case ids timed per request: every placement and trial of the first ``timed_sources`` sources of each
    dataset in panel order (a declared subset, fixed by the panel's seed before any model output; nested).

    Raises:
        ValueError: naming ``timed_sources`` when it is not an integer >= 0.
    """
    if isinstance(timed_sources, bool) or int(timed_sources) != timed_sources or timed_sources < 0:
        raise ValueError(f"timed_sources={timed_sources!r} must be an integer >= 0 (sources per dataset)")
    order: dict[str, list[str]] = {}
    for c in placement:
        seen = order.setdefault(c.example.dataset, [])
        if c.example.id not in seen:
            seen.append(c.example.id)
    timed = {(d, i) for d, ids in order.items() for i in ids[: int(timed_sources)]}
    return [trial_case_id(c.case_id, t) for t in range(int(trials)) for c in placement
            if (c.example.dataset, c.example.id) in timed]
