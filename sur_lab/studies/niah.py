"""Erasing-NIAH: two same-key needles in a haystack of real Wikipedia paragraphs; deleting one changes the answer
(section 4.2, appendix 7.5).

The original 96 cases are not public; this module builds the construction. A case is a chat prompt whose documents are
shuffled 2WikiMultiHopQA corpus paragraphs (``Title: ...`` blocks separated by blank lines) holding two needles
``"One of the special magic numbers for KEY is: VALUE."`` with the same KEY and different 7-digit VALUEs, each its own
block. The question asks for all of KEY's numbers in order of appearance; the original answer lists both values, and
deleting one needle's block (with its blank-line separator) leaves exactly the documents without it, whose answer is
the other value alone. The prompt follows RULER's multi-value NIAH wording (instruction, needle and question); a short
assistant answer prefix (the key's name) is part of the query, as in RULER.

Scoring (appendix 7.5): :func:`parse_niah_answer` extracts every digit run after explicit response/channel boundaries
with marked thinking blocks removed; ordinary newlines do not truncate; nothing is de-duplicated or matched against the
gold list. Strict exact match (:func:`niah_exact_match`) requires the parsed list to equal the gold list in order and
multiplicity.

The study (notebook 02 and ``sur-lab sweep niah`` call the same methods): :data:`STUDY`, a
:class:`~sur_lab.studies.base.Study` declaring :data:`PRESETS` (sizes), :data:`FIXED` (the other parameters' defaults),
its cases and methods; the base's :meth:`STUDY.sweep` returns the records, the sweep folder (named the same way for
both, so each resumes the other's records) and the cases. The report functions are in the last section
(:func:`budget_table`, :func:`paired_differences`, :func:`table12`, the figures).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sur_lab.analysis.decisions import SEPARATED, Family, PowerBasis, PowerDesign, discordance_from_marginals
from sur_lab.analysis.endpoints import canonical_answer_ids
from sur_lab.analysis.scoring import END_OF_TURN_TOKENS
from sur_lab.data.text import char_token_span, join_blocks
from sur_lab.edits import EditedContext, build_edit, chat_cuts, render_chat
from sur_lab.repair import REFERENCE_METHODS as REFERENCES
from sur_lab.studies.base import Report, Study

#: RULER's multi-value NIAH instruction, placed before the documents.
NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
#: One needle (RULER's wording).
NEEDLE_TEMPLATE = "One of the special magic numbers for {key} is: {value}."
#: The question (the relevance query of SUR and BM25).
QUESTION_TEMPLATE = (
    "What are all the special magic numbers for {key} mentioned in the provided text? "
    "Answer with the numbers only, separated by commas."
)
#: Assistant answer prefix appended to the query after the chat template's generation prompt (RULER's answer prefix).
ANSWER_PREFIX_TEMPLATE = "The special magic numbers for {key} mentioned in the provided text are:"
#: Needle depths are drawn at least this far apart (fraction of the filler tokens).
MIN_DEPTH_GAP = 0.05
#: The fourteen allocators in the order of Tables 2–6.
PAPER_ALLOCATORS = (
    "SUR",
    "Dense tokens",
    "Max-relevance contiguous",
    "BM25 (same units)",
    "Random semantic units",
    "ProphetKV-Adapted",
    "InfoFlow-Motivated",
    "Cache-Craft-Adapted",
    "CacheBlend-Adapted",
    "A3-Adapted",
    "LegoLink-Adapted",
    "CacheTune-Adapted",
    "SpecCache-Adapted",
    "Clean-state oracle",
)

#: Methods beyond the paper in the ``paper`` and ``default`` presets (issue 26): SUR's tie-robust variant, the edit-local baselines
#: of "Contiguity, Not Importance" and the Erratum reference operator (listed with the references).
BEYOND_PAPER = ("SUR-IDF", "Edit-local window", "Edit-local + SUR", "Erratum")
#: SUR's design factors (appendix 9.3), one at a time: ``(factor, the paper's setting, the changed setting, method)``.
#: Each method is SUR with exactly one option changed (``docs/allocators.md``); the bonus factor has two changes.
SUR_FACTORS = (
    ("aggregation", "top4", "mean", "SUR[aggregation=mean]"),
    ("partial_unit", "forward", "prefix", "SUR[partial_unit=prefix]"),
    ("allowance_base", "suffix", "prompt", "SUR[allowance_base=prompt]"),
    ("bonus", "paper", "idf", "SUR-IDF"),
    ("bonus", "paper", "off", "SUR[bonus=off]"),
)
#: Appendix 9.3's second arm: mean aggregation, prefix partial unit and whole-prompt allowance changed together.
JOINT_ARM = "SUR[aggregation=mean,partial_unit=prefix,allowance_base=prompt]"
#: The matched controls of text boundaries that appendix 9.3 says are missing (beyond the paper, issue 28): SUR's
#: region allocation over equal token blocks, and k windows around the top tokens (k = SUR's interval count).
BOUNDARY_CONTROLS = ("Fixed blocks", "Multiple local windows")
#: The full one-factor-at-a-time ablation (the ``paper`` preset's ``ablation``).
ABLATION = (*(f[3] for f in SUR_FACTORS), JOINT_ARM, *BOUNDARY_CONTROLS)
#: Seed of the frozen holdout roster of the matched-token study (Table 14 analogue, :func:`matched_sweep`). No design
#: run used it: every NIAH run before issue 28 (notebook 02, the tests, the reported default runs) used seed 0.
HOLDOUT_SEED = 9314

#: The budget (%) of the primary comparison: the ``default`` preset is sized to separate SUR at 5 % from Shift.
PRIMARY_BUDGET = 5.0
#: The budgets (%) of the secondary families :data:`RIVALS` and :data:`BEYOND`: the paper's headline budgets, so that
#: the ``paper`` preset's six budgets do not multiply the families (a run without them uses every budget it ran).
FAMILY_BUDGETS = (2.0, 5.0)
#: The declared families of notebook 02 (issue 36; :mod:`sur_lab.analysis.decisions`), fixed before any run. The
#: lead endpoint is strict EM, or agreement with Re-prefill when Re-prefill's EM is below
#: :data:`sur_lab.studies.presets.EM_LEAD_MIN`; cases are the paired units (independent constructions, no clusters).
PRIMARY = Family("primary", "binary", f"SUR at {PRIMARY_BUDGET:g} % minus Shift on the lead endpoint", primary=True)
RIVALS = Family("SUR against the references and the paper's allocators", "binary",
                "SUR at each family budget minus Shift and Re-prefill (the primary excepted) and minus each other "
                "allocator of Tables 2-6 at the same budget, on the lead endpoint")
BEYOND = Family("beyond the paper", "binary",
                "SUR-IDF, the edit-local window, edit-local + SUR and Erratum minus SUR at each family budget, on the "
                "lead endpoint")
ABLATION_FAMILY = Family("SUR's design factors", "binary",
                         "each one-factor variant and boundary control minus SUR at the same budget, per endpoint")
MATCHED = Family("matched tokens (holdout roster)", "binary",
                 "the region arm (SUR's whole units up to its stopping point) minus each token-level allocator at "
                 "the same per-case count, at each matched budget, every length pooled, per endpoint")
MATCHED_BY_LENGTH = Family("matched tokens by context length (holdout roster)", "binary",
                           "the same comparisons within each context length (1K, 2K, ...), per endpoint")
#: The power statement's basis (issue 40; :data:`POWER`): the primary comparison's discordance rate, from the paper's
#: Table 2 (Qwen3-8B, 96 cases): SUR at 5 % has 98.96 % EM and Shift 0 %, so every case SUR answers is discordant.
PRIMARY_POWER = PowerBasis(discordance_from_marginals(0.9896, 0.0),
                           "the paper's Table 2 (Qwen3-8B): SUR 5 % 98.96 % EM against Shift's 0 %")
ALL_AGAINST_REFERENCES = Family("every allocator against Shift and Re-prefill (the figure)", "binary",
                                "each allocator at each budget minus Shift and minus Re-prefill, on one endpoint")

#: Holdout cases of the matched-token sweep at ``default``. Issue 40 asks 120 (at 80 % power, two-sided 5 %, paired
#: binary outcomes, about 120 cases separate the paper's +9.85 pp at the smaller support of Table 14; 600 its +1.84 pp
#: at the larger one), but a matched case costs one to two minutes on 2 cores (Dense tokens' scattered refresh
#: dominates), so 120 cases alone would overrun the suite's 3 hours: ``default`` holds 24 (12 at each of 1K and 2K
#: tokens), which separates only large differences (its printed smallest separable difference says how large), and
#: ``paper`` holds the issue's size and beyond (600, the paper's holdout of 599).
MATCHED_DEFAULT_CASES = 24
#: Study sizes by preset (issue 13; :func:`sur_lab.studies.presets.resolve_preset`). ``default`` is sized so that a
#: paired bootstrap can separate SUR-5 % from Shift on the Qwen study model if the paper's effect exists there (48
#: cases, 24 at each of 1K and 2K tokens: issue 23 spent the time batched answering saves on more cases and a second
#: length), and compares SUR with its tie-robust variant SUR-IDF beside the matched controls, the edit-local
#: baselines and Erratum (:data:`BEYOND_PAPER`, issue 26's paired tables come from this run).
#: ``ablation`` (SUR's variants and the boundary controls, run with the allocators on the same cases) and
#: ``matched_allocators`` (token-level allocators given the region arm's per-case count on the holdout roster; ``[]``:
#: no matched-token sweep; ``matched_cases``: the holdout roster's size, cases alternating over ``context_lens``) are
#: the design-evidence lists of issue 28: the full ones in ``paper``, reduced ones in ``default`` (the bonus factor is
#: SUR-IDF, already among its allocators). The matched-token sweep's sizes are issue 40's: :data:`MATCHED_DEFAULT_CASES`
#: holdout cases at ``default`` against Dense tokens alone (the paper's Table 14 compares SUR V1 with token selection
#: by the query score, which is SUR's own token score: Dense tokens), 600 at ``paper`` (the paper's holdout: 599).
PRESETS = {
    "smoke": {"context_lens": [256], "num_cases": 1, "budgets": [2, 5], "max_new_tokens": 4,
              "allocators": ["SUR", "Dense tokens", "Max-relevance contiguous", "BM25 (same units)",
                             "Random semantic units", "CacheBlend-Adapted", "Edit-local window", "Erratum"],
              "ablation": ["SUR[aggregation=mean]", "Fixed blocks", "Multiple local windows"],
              "matched_allocators": ["Dense tokens"], "matched_cases": 1},
    "default": {"context_lens": [1024, 2048], "num_cases": 48, "budgets": [2, 5], "max_new_tokens": 16,
                "allocators": ["SUR", "SUR-IDF", "Dense tokens", "Max-relevance contiguous", "BM25 (same units)",
                               "Random semantic units", "Edit-local window", "Edit-local + SUR", "Erratum"],
                "ablation": ["SUR[aggregation=mean]", "SUR[partial_unit=prefix]", "Fixed blocks",
                             "Multiple local windows"],
                "matched_allocators": ["Dense tokens"], "matched_cases": MATCHED_DEFAULT_CASES},
    "paper": {"context_lens": [1024, 2048, 4096, 8192, 16384, 32768], "num_cases": 96,
              "budgets": [2, 5, 10, 20, 40, 80], "max_new_tokens": 32, "allocators": [*PAPER_ALLOCATORS, *BEYOND_PAPER],
              "ablation": list(ABLATION),
              "matched_allocators": ["Dense tokens", "ProphetKV-Adapted", "InfoFlow-Motivated", "Cache-Craft-Adapted",
                                     "CacheBlend-Adapted", "A3-Adapted", "Clean-state oracle"],
              "matched_cases": 600},
}
#: The study's name in the registry (``sur-lab sweep niah``), its notebook, and its sweep folders' prefix.
NAME = "niah"
NOTEBOOK = "02_allocation_geometry"
FOLDER = "02_niah"
#: Parameters that are not preset sizes, at the notebook's defaults (the literals of its ``parameters`` cell).
FIXED = {"depths": [0.25, 0.5, 0.75], "references": ["Dirty", "Shift", "Replay", "Re-prefill"],
         "matched_region": "SUR", "matched_count": "whole_units", "matched_budgets": [2, 5],
         "holdout_seed": HOLDOUT_SEED}

_ADJECTIVES = (
    "amber", "bold", "brave", "calm", "clever", "crisp", "dusty", "eager", "faint", "fancy", "gentle", "gleaming",
    "golden", "hollow", "humble", "icy", "jolly", "lively", "lucky", "mellow", "misty", "noble", "odd", "quiet",
    "rapid", "rustic", "silent", "silver", "smooth", "swift", "tender", "vivid", "wandering", "wild", "witty", "young",
)
_NOUNS = (
    "anchor", "badger", "beacon", "canyon", "cedar", "comet", "crane", "delta", "ember", "falcon", "fern", "harbor",
    "heron", "island", "lantern", "maple", "meadow", "otter", "pebble", "pine", "prairie", "quartz", "raven", "reef",
    "river", "saddle", "sparrow", "summit", "thistle", "tide", "tulip", "valley", "walnut", "willow", "wren", "zephyr",
)
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
#: Explicit response/channel boundaries: the answer is the text after the last one present.
RESPONSE_BOUNDARIES = (
    "</think>",
    "<|channel|>final<|message|>",
    "<|start_header_id|>assistant<|end_header_id|>",
    "<|im_start|>assistant",
)


def parse_niah_answer(text: str) -> tuple[str, ...]:
    """The ordered list of numbers in a generated answer (appendix 7.5).

    Steps: remove ``<think>...</think>`` blocks; keep the text after the last explicit response/channel boundary
    (:data:`RESPONSE_BOUNDARIES`); an unclosed ``<think>`` means the answer never left its thinking block (empty
    result); cut at the first end-of-turn token; return every maximal run of ASCII digits in order. Ordinary newlines
    do not truncate; repeats are kept; the gold list is never consulted.

    Args:
        text: decoded generation (``None`` is treated as empty).

    Returns:
        Tuple of digit strings (possibly empty).
    """
    if not text:
        return ()
    t = _THINK_BLOCK.sub(" ", text)
    cut = max((t.rfind(b) + len(b) if t.rfind(b) >= 0 else -1) for b in RESPONSE_BOUNDARIES)
    if cut >= 0:
        t = t[cut:]
    if "<think>" in t.lower():
        return ()
    for tok in END_OF_TURN_TOKENS:
        end = t.find(tok)
        if end >= 0:
            t = t[:end]
    return tuple(re.findall(r"[0-9]+", t))


def niah_exact_match(parsed: Sequence[str], gold: Sequence[str]) -> bool:
    """Strict EM: the parsed list equals the gold list in order and multiplicity (appendix 7.5)."""
    return tuple(parsed) == tuple(gold)


def niah_scorer(case: Any, text: str) -> bool:
    """Sweep scorer: strict EM of :func:`parse_niah_answer` ``(text)`` against ``case.gold``."""
    return niah_exact_match(parse_niah_answer(text), case.gold)


@dataclass(frozen=True)
class NiahCase:
    """One Erasing-NIAH case.

    Attributes:
        case_id: stable identifier (``niah-{context_len}-{index:03d}``).
        key: the needles' shared key (``adjective-noun``).
        values: the two values in order of appearance (7-digit strings).
        deleted: index in ``values`` of the deleted needle (0 = first, 1 = second).
        gold_original: the original context's answer (both values, in order).
        gold: the edited context's answer (the retained value).
        context_len: requested pre-query length, tokens.
        depths: the needles' depths in order of appearance (fraction of the filler tokens before them, in [0, 1]).
        documents: the original documents text.
        needle_char_spans: each needle sentence's ``(start, end)`` in the original pre-query text
            (``edit.original_text``).
        needle_token_spans: each needle sentence's ``(start, end)`` token span in ``edit.original_ids``.
        deleted_char_span: the deleted block's ``(start, end)`` in the original pre-query text (the needle and its
            blank-line separator; equals ``edit.deleted_char_span``).
        deleted_token_span: ``(p, p + d)`` in ``edit.original_ids``.
        kept_char_span: the retained needle sentence in ``edit.edited_text``.
        kept_token_span: the retained needle sentence's token span in ``edit.edited_ids``.
        seed: the case's own seed.
        edit: the edit (deleting ``deleted_char_span``), with the question as relevance query.
        answer_ids: the retained value's token ids as the model would write them right after the query
            (:func:`sur_lab.analysis.endpoints.canonical_answer_ids`: a leading space after RULER's answer prefix),
            teacher-forced for every record's ``gold_nll`` and ``gold_margin`` (issues 25, 26); ``None`` when built
            without a tokenizer-derived target.
    """

    case_id: str
    key: str
    values: tuple[str, str]
    deleted: int
    gold_original: tuple[str, ...]
    gold: tuple[str, ...]
    context_len: int
    depths: tuple[float, float]
    documents: str = field(repr=False)
    needle_char_spans: tuple[tuple[int, int], tuple[int, int]]
    needle_token_spans: tuple[tuple[int, int], tuple[int, int]]
    deleted_char_span: tuple[int, int]
    deleted_token_span: tuple[int, int]
    kept_char_span: tuple[int, int]
    kept_token_span: tuple[int, int]
    seed: int
    edit: EditedContext = field(repr=False)
    answer_ids: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        """N, tokens of the original pre-query sequence (chat template included)."""
        return self.edit.num_tokens

    @property
    def deleted_depth(self) -> float:
        """Depth of the deleted needle."""
        return self.depths[self.deleted]

    def meta(self) -> dict[str, Any]:
        """Flat scalars for sweep records: task, context length, depths, which needle was deleted, spans."""
        return {
            "dataset": "erasing-niah",
            "context_len": self.context_len,
            "num_tokens": self.num_tokens,
            "depth_first": self.depths[0],
            "depth_second": self.depths[1],
            "deleted_needle": "first" if self.deleted == 0 else "second",
            "deleted_depth": self.deleted_depth,
            "key": self.key,
            "gold_original": ",".join(self.gold_original),
            "deleted_token_start": self.deleted_token_span[0],
            "deleted_token_end": self.deleted_token_span[1],
            "kept_token_start": self.kept_token_span[0],
            "kept_token_end": self.kept_token_span[1],
        }

    def sweep_case(self):
        """This case as a :class:`sur_lab.sweeps.Case` (gold = the edited answer, meta = :meth:`meta`, answer target
        :attr:`answer_ids`)."""
        from sur_lab.sweeps import Case

        return Case(self.case_id, self.edit, self.gold, self.meta(), answer_ids=self.answer_ids)


def build_niah_case(
    tokenizer,
    corpus: Sequence[Any],
    *,
    context_len: int,
    depths: tuple[float, float],
    delete: int,
    seed: int,
    case_id: str | None = None,
    answer_prefix: bool = True,
) -> NiahCase:
    """Build one Erasing-NIAH case.

    Args:
        tokenizer: the target model's fast tokenizer (with a chat template).
        corpus: filler paragraphs with ``title`` and ``text`` (e.g. :func:`sur_lab.data.qa.load_corpus`).
        context_len: target pre-query length in tokens (>= 128); filler paragraphs are added in a seeded random
            order until the prompt reaches it (the result overshoots by less than one paragraph).
        depths: the two needles' depths, each in [0, 1], as fractions of the filler tokens before the needle; the
            needle with the smaller depth appears first (equal depths: the first given appears first). Each needle
            goes to the paragraph boundary nearest its depth.
        delete: which needle to delete, as an index into ``depths`` (0 or 1).
        seed: seed for the key, the values and the filler order.
        case_id: identifier (default ``niah-{context_len}-s{seed}``).
        answer_prefix: append RULER's answer prefix after the chat template's generation prompt.

    Returns:
        NiahCase whose ``edit`` deletes the chosen needle's block.

    Raises:
        ValueError: naming ``context_len`` (< 128), ``depths`` (outside [0, 1]), ``delete`` (not 0 or 1) or
            ``corpus`` (too small for ``context_len``), before any tokenization.
    """
    if int(context_len) != context_len or context_len < 128:
        raise ValueError(f"context_len must be an integer >= 128 tokens; got {context_len!r}")
    if len(depths) != 2 or not all(0.0 <= float(x) <= 1.0 for x in depths):
        raise ValueError(f"depths must be two fractions in [0, 1]; got {depths!r}")
    if delete not in (0, 1):
        raise ValueError(f"delete must be 0 or 1 (an index into depths); got {delete!r}")
    if len(corpus) == 0:
        raise ValueError("corpus is empty")
    rng = np.random.default_rng(seed)
    key = f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"
    first_value = int(rng.integers(1_000_000, 10_000_000))
    second_value = first_value
    while second_value == first_value:
        second_value = int(rng.integers(1_000_000, 10_000_000))
    needle_values = (str(first_value), str(second_value))  # by index into ``depths``
    question = QUESTION_TEMPLATE.format(key=key)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    overhead = count(NIAH_INSTRUCTION) + 2 * count(NEEDLE_TEMPLATE.format(key=key, value=first_value)) + 40
    filler, filler_tokens, lengths = [], 0, []
    for idx in rng.permutation(len(corpus)):
        if filler_tokens + overhead >= context_len:
            break
        p = corpus[int(idx)]
        block = f"Title: {p.title}\n{p.text.strip()}"
        n = count(block) + 1
        filler.append(block)
        lengths.append(n)
        filler_tokens += n
    else:
        if filler_tokens + overhead < context_len:
            raise ValueError(f"corpus has too few paragraphs ({len(corpus)}) for context_len={context_len}")
    # Insert each needle at the paragraph boundary whose filler-token depth is closest to the requested one.
    bounds = np.concatenate(([0], np.cumsum(lengths))) / max(1, filler_tokens)
    slots = [int(np.argmin(np.abs(bounds - float(x)))) for x in depths]
    # Indices into ``depths`` by appearance; needles sharing a slot keep their depth order.
    order = sorted(range(2), key=lambda i: (slots[i], float(depths[i]), i))
    blocks = list(filler)
    for i in reversed(order):
        blocks.insert(slots[i], NEEDLE_TEMPLATE.format(key=key, value=needle_values[i]))
    needle_block = {i: slots[i] + order.index(i) for i in range(2)}  # block index after insertion
    documents, spans = join_blocks(blocks)

    text, query_text, doc_start, containers = render_chat(tokenizer, documents, question, instruction=NIAH_INSTRUCTION)
    if answer_prefix:
        query_text = query_text + ANSWER_PREFIX_TEMPLATE.format(key=key)
    del_block = needle_block[delete]
    span = (doc_start + spans[del_block][0], doc_start + spans[del_block][1])
    # Token segments (head, one per paragraph, query): the edit never relies on a BPE merge across a boundary.
    edit = build_edit(tokenizer, text, query_text, span, question=question, containers=containers,
                      cuts=chat_cuts(text, doc_start, documents))

    offsets = edit.original_offsets
    needle_chars, needle_tokens = [], []
    block_starts = np.concatenate(([0], np.cumsum([len(b) + 2 for b in blocks])))
    for i in order:
        b = needle_block[i]
        start = doc_start + int(block_starts[b])
        end = start + len(blocks[b])
        needle_chars.append((start, end))
        needle_tokens.append(char_token_span(offsets, start, end))
    kept = 1 - order.index(delete)
    ks, ke = needle_chars[kept]
    width = span[1] - span[0]
    kept_chars = (ks, ke) if ke <= span[0] else (ks - width, ke - width)
    kt = needle_tokens[kept]
    kept_tokens = kt if kt[1] <= edit.prefix_len else (kt[0] - edit.deleted_len, kt[1] - edit.deleted_len)
    values = tuple(needle_values[i] for i in order)
    return NiahCase(
        case_id=case_id or f"niah-{context_len}-s{seed}",
        key=key,
        values=values,
        deleted=order.index(delete),
        gold_original=values,
        gold=(values[kept],),
        context_len=int(context_len),
        depths=tuple(float(depths[i]) for i in order),
        documents=documents,
        needle_char_spans=tuple(needle_chars),
        needle_token_spans=tuple(needle_tokens),
        deleted_char_span=span,
        deleted_token_span=(edit.prefix_len, edit.prefix_len + edit.deleted_len),
        kept_char_span=kept_chars,
        kept_token_span=kept_tokens,
        seed=int(seed),
        edit=edit,
        answer_ids=tuple(canonical_answer_ids(tokenizer, values[kept], query_text)),
    )


def build_niah_cases(
    tokenizer,
    *,
    context_lens: Sequence[int] = (1024,),
    depths: Sequence[float] = (0.25, 0.5, 0.75),
    num_cases: int = 4,
    seed: int = 0,
    corpus: Sequence[Any] | None = None,
) -> list[NiahCase]:
    """A roster of Erasing-NIAH cases cycling over context lengths and deleted-needle depths.

    Case i has context length ``context_lens[i % len(context_lens)]`` and deleted-needle depth
    ``depths[(i // len(context_lens)) % len(depths)]``. Deletion order alternates so that any roster is balanced: even
    cases delete the second needle, odd cases the first. The retained needle's depth is drawn uniformly on the side
    this requires, within [0.05, 0.95] and at least :data:`MIN_DEPTH_GAP` from the deleted one (the other side when
    that interval is empty). Every random choice of case i comes from ``SeedSequence([seed, i])``, so a case does not
    depend on ``num_cases`` and the roster is fixed before any model output is seen. The paper's grid is 96 cases over
    1K–32K tokens.

    Args:
        tokenizer: the target model's tokenizer.
        context_lens: pre-query lengths, tokens (each >= 128).
        depths: deleted-needle depths in [0, 1].
        num_cases: number of cases (>= 1).
        seed: roster seed.
        corpus: filler paragraphs (default: :func:`sur_lab.data.qa.load_corpus`).

    Raises:
        ValueError: naming ``num_cases``, ``context_lens`` or ``depths`` when empty or out of range (before any work).
    """
    if int(num_cases) != num_cases or num_cases < 1:
        raise ValueError(f"num_cases must be an integer >= 1; got {num_cases!r}")
    if not context_lens or any(int(c) != c or c < 128 for c in context_lens):
        raise ValueError(f"context_lens must be non-empty integers >= 128; got {context_lens!r}")
    if not depths or any(not 0.0 <= float(x) <= 1.0 for x in depths):
        raise ValueError(f"depths must be non-empty fractions in [0, 1]; got {depths!r}")
    if corpus is None:
        from sur_lab.data.qa import load_corpus

        corpus = load_corpus()
    cases = []
    for i in range(int(num_cases)):
        ctx = int(context_lens[i % len(context_lens)])
        deleted_depth = float(depths[(i // len(context_lens)) % len(depths)])
        case_seed = int(np.random.SeedSequence([int(seed), i]).generate_state(1)[0])
        rng = np.random.default_rng([case_seed, 1])
        after = (deleted_depth + MIN_DEPTH_GAP, 0.95)  # the retained needle follows: the first is deleted
        before = (0.05, deleted_depth - MIN_DEPTH_GAP)  # the retained needle precedes: the second is deleted
        lo, hi = after if i % 2 else before
        if hi < lo:
            lo, hi = before if i % 2 else after
        kept_depth = float(np.round(rng.uniform(lo, hi), 3))
        cases.append(
            build_niah_case(
                tokenizer, corpus, context_len=ctx, depths=(deleted_depth, kept_depth), delete=0, seed=case_seed,
                case_id=f"niah-{ctx}-{i:03d}",
            )
        )
    return cases


# ---------------------------------------------------------------------------------------------------------------------
# The study (issue 39: declarations on the Study base; params, folder, sweep, mde and conclusion are the base's)


#: The primary comparison's power design (issue 40): the study's ``mde`` and ``power_line`` (the
#: :class:`~sur_lab.studies.base.Study` base's) at its parameters.
POWER = PowerDesign(f"SUR {PRIMARY_BUDGET:g}% vs Shift on the lead endpoint", PRIMARY, PRIMARY_POWER,
                    lambda p: p["num_cases"])


class NiahStudy(Study):
    """Erasing-NIAH (notebook 02): every case x (references + allocators x budgets), strictly scored
    (:func:`niah_scorer`). NIAH has no latency endpoint: its answers are never timed."""

    name, notebook, folder_prefix = NAME, NOTEBOOK, FOLDER
    presets, fixed = PRESETS, FIXED
    folder_keys = {"ctx": "context_lens", "n": "num_cases", "b": "budgets", "tok": "max_new_tokens", "seed": "seed",
                   "eb": "eval_batch"}
    scorer, parser = staticmethod(niah_scorer), staticmethod(parse_niah_answer)
    power = POWER
    families = (PRIMARY, RIVALS, BEYOND, ABLATION_FAMILY, MATCHED, MATCHED_BY_LENGTH, ALL_AGAINST_REFERENCES)

    def methods(self, p: Mapping[str, Any]) -> list[str]:
        """The sweep's methods for parameters ``p``: the references, then the allocators in Table 2-6 order (others
        after, in the given order), then the ``ablation`` methods not already listed (SUR's variants and the boundary
        controls, on the same cases and budgets). A reference operator named among the allocators (the ``paper``
        preset's ``"Erratum"``) is listed after the references."""
        from sur_lab.repair import REFERENCE_OPERATORS

        refs = list(p["references"])
        refs += [a for a in p["allocators"] if a in REFERENCE_OPERATORS and a not in refs]
        allocators = [a for a in p["allocators"] if a not in REFERENCE_OPERATORS]
        ordered = [a for a in PAPER_ALLOCATORS if a in allocators] + [a for a in allocators
                                                                      if a not in PAPER_ALLOCATORS]
        ordered += [a for a in dict.fromkeys(p.get("ablation", ())) if a not in ordered]
        return refs + ordered

    def cases(self, tokenizer, p: Mapping[str, Any], seed: int = 0, *,
              corpus: Sequence[Any] | None = None) -> list:
        """The study's cases for parameters ``p``: :func:`build_niah_cases` as :class:`sur_lab.sweeps.Case` objects
        (``corpus``: filler paragraphs, default :func:`sur_lab.data.qa.load_corpus`).

        Raises:
            ValueError: as :func:`build_niah_cases`.
        """
        built = build_niah_cases(tokenizer, context_lens=p["context_lens"], depths=p["depths"],
                                 num_cases=p["num_cases"], seed=seed, corpus=corpus)
        return [c.sweep_case() for c in built]

    def sweep_cases(self, cases: Any, p: Mapping[str, Any]) -> list:
        """:meth:`cases` are sweep cases already."""
        return list(cases)

    def report(self, records: pd.DataFrame, p: Mapping[str, Any], *, decide: bool = True) -> Report:
        """The lead endpoint's budget table (:func:`budget_table`), the declared families (:func:`decide_families`)
        and their conclusion lines (:func:`conclusion`); the lead endpoint is EM when Re-prefill's EM allows
        (:func:`sur_lab.studies.presets.lead_endpoint`). ``decide``: ``False`` at a plumbing-check size."""
        from sur_lab.studies.presets import lead_endpoint

        metric = lead_endpoint(float(records.loc[records["method"] == "Re-prefill", "em"].mean()))
        allocators = [m for m in self.methods(p) if m in set(records["method"]) and m not in p["references"]]
        decided = decide_families(records, metric=metric, decide=decide)
        return Report(tables={"budget": budget_table(records, metric), "decided": decided},
                      conclusion=conclusion(records, decided, metric=metric, allocators=allocators, decide=decide))


STUDY = NiahStudy()


# ---------------------------------------------------------------------------------------------------------------------
# The matched-token protocol on a holdout roster (appendix 9.3, Table 14; issues 28 and 40)


def region_label(region: str = "SUR", count: str = "whole_units") -> str:
    """The record method of the region arm under count rule ``count`` (:data:`sur_lab.allocators.COUNT_RULES`):
    ``"SUR (whole units)"`` for ``"whole_units"``, the region's own name for ``"selected"``.

    Raises:
        ValueError: naming ``count`` when it is not a count rule.
    """
    from sur_lab.allocators import COUNT_RULES

    if count not in COUNT_RULES:
        raise ValueError(f"count={count!r} must be one of {COUNT_RULES}")
    return region if count == "selected" else f"{region} (whole units)"


def matched_label(allocator: str, region: str = "SUR", count: str = "whole_units") -> str:
    """The record method of ``allocator`` at the region arm's count: ``"Dense tokens (matched to SUR (whole
    units))"`` (``count="selected"``: ``"Dense tokens (matched to SUR)"``).

    Raises:
        ValueError: as :func:`region_label`.
    """
    return f"{allocator} (matched to {region_label(region, count)})"


@dataclass(frozen=True)
class MatchedRegion:
    """A sweep method: the region arm of the matched-token protocol, SUR at the case's matched count n.

    n is :func:`sur_lab.allocators.region_count` ``(region, request, count)`` on the case's request at b. With
    ``count="whole_units"`` (the default, issue 40) n is SUR's natural stopping point: whole units in its ranked
    order until B = B(S, b) is reached (our reading of the paper's "SUR V1", whose count is not fixed by the budget),
    and SUR at the exact allowance n selects exactly those units (:func:`sur_lab.allocators.sur.whole_unit_count`);
    n differs between cases and from B. With ``"selected"`` n is the region's own count (B for SUR at the suffix
    budget: the Table 12 comparison again).

    Attributes:
        region: SUR or a SUR variant name (any region allocator with ``count="selected"``).
        budget_pct: b, % of the suffix, from which B and n follow (the record's budget).
        count: the count rule (:data:`sur_lab.allocators.COUNT_RULES`).
        protocol: ``"forward"`` (the rows are recomputed).

    Raises:
        ValueError: (at construction) naming ``region`` when unknown (or, for ``"whole_units"``, not SUR or a SUR
            variant), ``count`` when not a rule, or ``budget_pct`` outside [0, 100].
    """

    region: str
    budget_pct: float
    count: str = "whole_units"
    protocol: str = "forward"

    def __post_init__(self) -> None:
        from sur_lab.allocators import check_region
        from sur_lab.budget import check_budget

        check_region(self.region, self.count)
        object.__setattr__(self, "budget_pct", float(check_budget(self.budget_pct)))

    @property
    def name(self) -> str:
        """The record's method: :func:`region_label` ``(region, count)``."""
        return region_label(self.region, self.count)

    def repair(self, lm, prepared, *, executor: str, seed: int, options: Mapping[str, Any] | None):
        """The region's repair at exactly n positions on this case (a new cache; ``prepared`` is kept)."""
        from sur_lab.repair import repair

        n = _matched_count(lm, prepared, self.region, self.budget_pct, self.count, seed, options)
        return repair(lm, prepared, self.region, self.budget_pct, executor=executor, seed=seed, options=options,
                      allowance=n)


@dataclass(frozen=True)
class MatchedTokens:
    """A sweep method: the token-level ``allocator`` given exactly the region arm's count n on each case.

    The matched-token protocol of appendix 9.3 (Table 14; :func:`sur_lab.allocators.matched_token_selections`): on a
    case's request at budget b, n is :func:`sur_lab.allocators.region_count` ``(region, request, count)``, the count
    :class:`MatchedRegion` refreshes, and it becomes the exact allowance of the token-level allocator's repair
    (:func:`sur_lab.repair.repair` with ``allowance=n``), so the two supports differ only in which positions they
    hold. The record's ``allowance`` is n and its ``select_ms`` the token-level allocator's own selection (the count's
    computation is protocol bookkeeping, untimed).

    Attributes:
        allocator: a token-level allocator (:data:`sur_lab.allocators.TOKEN_LEVEL_ALLOCATORS`) or variant name.
        region: the region allocator or variant name whose count is matched (``"SUR"``).
        budget_pct: b, % of the suffix, at which the region's count is taken (the record's budget).
        count: the count rule (:data:`sur_lab.allocators.COUNT_RULES`; ``"whole_units"``: SUR's whole-unit stopping
            point, ``"selected"``: the region's own count).
        protocol: ``"forward"`` (the rows are recomputed).

    Raises:
        ValueError: (at construction) naming ``allocator`` or ``region`` when unknown or equal (``region`` also when
            ``count="whole_units"`` and it is not SUR or a SUR variant), ``count`` when not a rule, or
            ``budget_pct`` outside [0, 100].
    """

    allocator: str
    region: str
    budget_pct: float
    count: str = "whole_units"
    protocol: str = "forward"

    def __post_init__(self) -> None:
        from sur_lab.allocators import check_region, get_allocator
        from sur_lab.budget import check_budget

        get_allocator(self.allocator)
        check_region(self.region, self.count)
        if self.allocator == self.region:
            raise ValueError(f"allocator={self.allocator!r} must differ from region")
        object.__setattr__(self, "budget_pct", float(check_budget(self.budget_pct)))

    @property
    def name(self) -> str:
        """The record's method: :func:`matched_label` ``(allocator, region, count)``."""
        return matched_label(self.allocator, self.region, self.count)

    def repair(self, lm, prepared, *, executor: str, seed: int, options: Mapping[str, Any] | None):
        """The token-level repair at the region arm's count on this case (a new cache; ``prepared`` is kept)."""
        from sur_lab.repair import repair

        n = _matched_count(lm, prepared, self.region, self.budget_pct, self.count, seed, options)
        return repair(lm, prepared, self.allocator, self.budget_pct, executor=executor, seed=seed, options=options,
                      allowance=n)


def _matched_count(lm, prepared, region: str, budget_pct: float, count: str, seed: int,
                   options: Mapping[str, Any] | None) -> int:
    """n of :func:`sur_lab.allocators.region_count` on the case's request at ``budget_pct`` (units kept on
    ``prepared``), computed once per prepared edit: kept in ``prepared.matched_counts`` and read back for the same
    region, budget, count, seed and ``options`` object (every arm of a case)."""
    from sur_lab.allocators import AllocationRequest, region_count

    key = (region, float(budget_pct), count, int(seed))
    kept = prepared.matched_counts.get(key)
    if kept is not None and kept[0] is options:
        return kept[1]
    opts = dict(options or {})
    if prepared.dirty_cache is not None:
        opts.setdefault("dirty_cache", prepared.dirty_cache)
    request = AllocationRequest(lm, prepared.edit, budget_pct, shift_cache=prepared.shift_cache,
                                units=prepared.units, seed=seed, options=opts)
    n = region_count(region, request, count)
    if prepared.units is None and request.units is not None:
        prepared.units = request.units
    prepared.matched_counts[key] = (options, n)
    return n


def matched_methods(p: Mapping[str, Any]) -> list:
    """The matched-token sweep's methods for parameters ``p``: Shift and Re-prefill (when among ``p["references"]``),
    then per matched budget of ``p["matched_budgets"]`` the region arm (:class:`MatchedRegion` of
    ``p["matched_region"]`` under ``p["matched_count"]``) and one :class:`MatchedTokens` per token-level allocator of
    ``p["matched_allocators"]``."""
    refs = [r for r in p["references"] if r in ("Shift", "Re-prefill")]
    region, count = p["matched_region"], p["matched_count"]
    budgets = p["matched_budgets"]
    return [*refs, *(MatchedRegion(region, b, count) for b in budgets),
            *(MatchedTokens(a, region, b, count) for a in p["matched_allocators"] for b in budgets)]


def matched_folder(lm, p: Mapping[str, Any], *, eval_batch: int | None = None, executor: str = "sequential",
                   outputs: Path | None = None) -> Path:
    """The matched-token sweep's folder (``02_niah_matched_...``: sizes, matched budgets, the count rule, the holdout
    seed, the evaluation batch, the executor when not sequential, the model's fingerprint)."""
    from sur_lab.sweeps import EVAL_BATCH, sweep_folder

    extra = {} if executor == "sequential" else {"ex": executor}
    return sweep_folder(f"{FOLDER}_matched", lm, outputs=outputs, ctx=p["context_lens"], n=p["matched_cases"],
                        b=p["matched_budgets"], count=p["matched_count"], tok=p["max_new_tokens"],
                        seed=p["holdout_seed"], eb=EVAL_BATCH if eval_batch is None else eval_batch, **extra)


def matched_sweep(lm, *, preset: str = "default", out: Path | str | None = None, workers: int = 1,
                  threads: int | None = None, address: str | None = None, executor: str = "sequential",
                  eval_batch: int | None = None, progress: bool = True,
                  **overrides: Any) -> tuple[pd.DataFrame, Path]:
    """Run (or resume) the matched-token study (Table 14 analogue) on the frozen holdout roster.

    The roster is :meth:`STUDY.cases` at the preset's sizes, ``p["matched_cases"]`` of them (alternating over
    ``context_lens``), with seed ``p["holdout_seed"]`` (:data:`HOLDOUT_SEED`, never used for design); the methods are
    :func:`matched_methods`: the region arm at each matched budget (:class:`MatchedRegion`: SUR's whole units up to
    its stopping point by default), and each token-level allocator at that exact count on the same case
    (:class:`MatchedTokens`). Records come from :func:`sur_lab.sweeps.run_sweep`, strictly scored like
    :meth:`STUDY.sweep`'s.

    Args:
        lm, out, workers, threads, address, executor, eval_batch, progress: as :meth:`STUDY.sweep`.
        preset, overrides: the parameters (:meth:`STUDY.params`; e.g. ``matched_allocators=["Dense tokens"]``,
            ``matched_budgets=[2, 5]``, ``matched_count="whole_units"``, ``holdout_seed=...``).

    Returns:
        ``(records, folder)``; ``records`` is empty (and nothing runs) when ``matched_allocators`` is empty.

    Raises:
        ValueError: naming a bad parameter (an unknown allocator or count rule, a budget outside [0, 100]), before
            any model call.
    """
    from sur_lab.sweeps import EVAL_BATCH, records_frame, run_sweep

    p = STUDY.params(preset, **overrides)
    eval_batch = EVAL_BATCH if eval_batch is None else eval_batch
    the_methods = matched_methods(p)  # MatchedRegion / MatchedTokens check names, counts and budgets here
    where = Path(out) if out is not None else matched_folder(lm, p, eval_batch=eval_batch, executor=executor)
    if not p["matched_allocators"]:
        return records_frame([]), where
    seed = int(p["holdout_seed"])
    the_cases = STUDY.cases(lm.tokenizer, {**p, "num_cases": p["matched_cases"]}, seed)
    records = run_sweep(lm, the_cases, the_methods, p["matched_budgets"], where, max_new_tokens=p["max_new_tokens"],
                        executor=executor, eval_batch=eval_batch, scorer=niah_scorer, parser=parse_niah_answer,
                        seed=seed, workers=workers, threads=threads, address=address, progress=progress)
    return records, where


def _decided(records: pd.DataFrame, pairs: Sequence[tuple[str, str]], metric: str, family: Family, *,
             decide: bool, n_boot: int, seed: int) -> pd.DataFrame:
    """:func:`sur_lab.analysis.decisions.paired_family` of ``pairs`` (arm labels, :func:`arm_labels`) on ``metric``,
    cases paired, with the differences in their printed unit (:func:`sur_lab.analysis.decisions.in_units`: ``delta``,
    ``delta_low``, ``delta_high``, ``delta_mde`` and ``unit``, "pp" for a 0/1 metric, :data:`METRIC_UNITS` else)."""
    from sur_lab.analysis.conclusions import arm_labels, paired_outcomes
    from sur_lab.analysis.decisions import DIFF_COLUMNS, in_units, kind_of, paired_family

    df = records.assign(arm=arm_labels(records), _m=records[metric].astype(np.float64))
    outcomes, _ = paired_outcomes(df, pairs, "_m")
    if not outcomes:
        from sur_lab.analysis.decisions import COLUMNS

        return pd.DataFrame(columns=[*COLUMNS, *DIFF_COLUMNS])
    kind = kind_of(df["_m"])
    if kind != family.kind:
        from dataclasses import replace

        family = replace(family, kind=kind)
    out = paired_family(outcomes, family=family, n_boot=n_boot, seed=seed, decide=decide)
    return in_units(out, unit=METRIC_UNITS.get(metric, ""))


#: The printed unit of a continuous record field's paired difference (a 0/1 field's is "pp").
METRIC_UNITS = {"nll_reprefill": "nats", "gold_nll": "nats", "gold_margin": "logits", "tv_reprefill": "TV",
                "nr_tv": "NR_TV"}


def length_label(context_len: float) -> str:
    """A context length's row label: ``"1K"`` for 1024 tokens, ``"32K"`` for 32768, the number otherwise
    (``"256"``)."""
    c = int(context_len)
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def _region_allowance(records: pd.DataFrame, region: str) -> np.ndarray:
    """B per record: Eq. 3's ``B(S, b)`` of the record's suffix at its budget, on the whole-prompt base when
    ``region`` binds ``allowance_base=prompt`` (the B from which the region's count starts); int64."""
    from sur_lab.allocators import resolve_method
    from sur_lab.budget import base_allowance

    base = resolve_method(region)[1].get("allowance_base", "suffix")
    return np.array([base_allowance(int(s), int(p) + int(s), float(b), base)
                     for s, p, b in zip(records["suffix_len"], records["prefix_len"], records["budget_pct"])],
                    dtype=np.int64)


def matched_counts(records: pd.DataFrame, *, region: str = "SUR", count: str = "whole_units") -> pd.DataFrame:
    """The matched count of every case and budget: the region arm's n beside the suffix allowance B it started from.

    Args:
        records: :func:`matched_sweep` records (``case_id``, ``context_len``, ``method``, ``budget_pct``,
            ``allowance``, ``prefix_len``, ``suffix_len``).
        region, count: the region arm (:func:`region_label`).

    Returns:
        One row per (case, budget), sorted by length, budget and case: ``case_id``, ``context_len``, ``length``
        (:func:`length_label`), ``budget_pct``, ``suffix_len``, ``allowance_b`` (B, positions), ``matched_count``
        (n, positions), ``extra`` (n - B) and ``ratio`` (n / B; NaN when B = 0).

    Raises:
        ValueError: naming ``records`` when it holds no region-arm row.
    """
    label = region_label(region, count)
    reg = records[records["method"] == label]
    if reg.empty:
        raise ValueError(f"records hold no {label!r} row (the region arm of the matched-token sweep)")
    b = _region_allowance(reg, region)
    n = reg["allowance"].to_numpy(np.int64)
    out = pd.DataFrame({"case_id": reg["case_id"].to_numpy(), "context_len": reg["context_len"].astype(int).to_numpy(),
                        "length": [length_label(c) for c in reg["context_len"]],
                        "budget_pct": reg["budget_pct"].astype(float).to_numpy(),
                        "suffix_len": reg["suffix_len"].astype(int).to_numpy(), "allowance_b": b,
                        "matched_count": n, "extra": n - b,
                        "ratio": np.where(b > 0, n / np.maximum(b, 1), np.nan)})
    return out.sort_values(["context_len", "budget_pct", "case_id"], ignore_index=True)


def count_summary(counts: pd.DataFrame) -> pd.DataFrame:
    """The count distribution of :func:`matched_counts`, per length and budget, then every length pooled
    (``length`` ``"all"``): ``cases``, ``mean_b``, ``min_count``, ``median_count``, ``mean_count``, ``max_count``,
    ``distinct_counts`` and ``share_at_b`` (% of cases whose n equals B).

    Raises:
        ValueError: if ``counts`` is empty.
    """
    if counts.empty:
        raise ValueError("counts is empty: no region-arm row")
    rows = []
    for (ctx, budget), g in [*counts.groupby(["context_len", "budget_pct"], sort=True),
                             *(((None, b), g) for b, g in counts.groupby("budget_pct", sort=True))]:
        n = g["matched_count"]
        rows.append({"length": "all" if ctx is None else length_label(ctx), "budget_pct": float(budget),
                     "cases": len(g), "mean_b": float(g["allowance_b"].mean()), "min_count": int(n.min()),
                     "median_count": float(n.median()), "mean_count": float(n.mean()), "max_count": int(n.max()),
                     "distinct_counts": int(n.nunique()),
                     "share_at_b": 100.0 * float((n == g["allowance_b"]).mean())})
    return pd.DataFrame(rows)


def plot_matched_counts(counts: pd.DataFrame):
    """The count distribution: per matched budget a panel of every case's matched count n against its suffix
    allowance B (one colour per context length), with the line n = B (the degenerate protocol's counts).

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: if ``counts`` is empty.
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    if counts.empty:
        raise ValueError("counts is empty: no region-arm row")
    budgets = sorted(counts["budget_pct"].unique())
    lengths = list(dict.fromkeys(counts.sort_values("context_len")["length"]))
    palette = dict(zip(lengths, sns.color_palette("crest", len(lengths))))
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.4 * len(budgets) + 1.2, 4.0), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        sub = counts[counts["budget_pct"] == budget]
        for length in lengths:
            at = sub[sub["length"] == length]
            ax.scatter(at["allowance_b"], at["matched_count"], s=18, alpha=0.8, color=palette[length], label=length)
        hi = float(max(sub["allowance_b"].max(), sub["matched_count"].max(), 1))
        ax.plot([0, hi], [0, hi], color="0.3", lw=0.9, ls="--", label="n = B")
        ax.set_xlabel("suffix allowance B (positions)")
        ax.set_ylabel("matched count n (positions)")
        ax.set_title(f"b = {budget:g} %")
    axes[0][-1].legend(title="context", fontsize=8)
    fig.tight_layout()
    return fig


def table14(records: pd.DataFrame, *, region: str = "SUR", count: str = "whole_units",
            metrics: Sequence[str] = ("em", "agree_reprefill"), n_boot: int = 10_000, seed: int = 20260928,
            decide: bool = True) -> pd.DataFrame:
    """Our Table 14: region against token-level selection at matched per-case counts, case-paired, every length
    pooled and per context length.

    For each matched budget and each token-level allocator of ``records`` (methods named :func:`matched_label`
    ``(allocator, region, count)``): the mean matched count n and the mean suffix allowance B it started from, then
    for each metric the region arm's and the token-level allocator's mean (×100) and the region minus token difference
    in pp. The pooled rows (``length`` ``"all"``) are the :data:`MATCHED` family and the per-length rows (``"1K"``,
    ``"2K"``, ...) the :data:`MATCHED_BY_LENGTH` family, each decided per metric by
    :func:`sur_lab.analysis.decisions.paired_family` (exact sign test, Newcombe interval, Holm over the family's
    rows).

    Args:
        records: :func:`matched_sweep` records (``case_id``, ``context_len``, ``method``, ``budget_pct``,
            ``allowance``, ``prefix_len``, ``suffix_len`` and the metrics).
        region, count: the region arm (:func:`region_label`).
        metrics: 0/1 record fields (``"em"``, ``"agree_reprefill"``).
        n_boot, seed, decide: as :func:`paired_differences`.

    Returns:
        One row per (length, budget, allocator), pooled rows first: ``length``, ``context_len`` (NaN when pooled),
        ``family``, ``budget_pct``, ``allocator``, ``mean_tokens`` (mean n), ``mean_b`` (mean B), ``n`` (cases),
        ``unit`` ("pp"), and per metric ``{metric}_region``, ``{metric}_token``, ``{metric}_delta``,
        ``{metric}_delta_low``, ``{metric}_delta_high``, ``{metric}_p_adj``, ``{metric}_delta_mde`` (the smallest
        difference the family's size could separate; the columns of
        :func:`sur_lab.analysis.decisions.in_units` in ``unit``) and ``{metric}_verdict``.

    Raises:
        ValueError: naming ``records`` when it holds no matched method or no region-arm row at a matched budget, or
            when a token-level record's count differs from the region arm's on its case (the protocol was broken);
            naming ``metrics`` when one is not a record field; naming ``count`` when it is not a count rule.
    """
    from sur_lab.analysis.decisions import kind_of

    missing = [m for m in metrics if m not in records.columns]
    if missing:
        raise ValueError(f"metrics {missing} are not record fields")
    numeric = [m for m in metrics if kind_of(records[m]) != "binary"]
    if numeric:
        raise ValueError(f"metrics {numeric} are not 0/1 record fields (Table 14 compares proportions, in pp)")
    label = region_label(region, count)
    suffix = f" (matched to {label})"
    token_methods = [m for m in dict.fromkeys(records["method"]) if str(m).endswith(suffix)]
    if not token_methods:
        raise ValueError(f"records hold no method matched to {label!r} (names ending in {suffix!r})")
    budgets = sorted(records.loc[records["method"].isin(token_methods), "budget_pct"].unique())
    for budget in budgets:
        at_b = records[records["budget_pct"] == budget]
        counts = at_b[at_b["method"] == label].set_index("case_id")["allowance"]
        if counts.empty:
            raise ValueError(f"records hold no {label!r} row at {budget:g} %")
        for method in token_methods:
            mine = at_b[at_b["method"] == method].set_index("case_id")["allowance"]
            if not mine.index.isin(counts.index).all() or (mine != counts.reindex(mine.index)).any():
                raise ValueError(f"records: {method!r} at {budget:g} % does not select {label!r}'s count on every "
                                 "case")
    # The per-length family pairs arms within one length: its arm labels carry the length ("... @1K 2%").
    tagged = records.assign(method=[f"{m} @{length_label(c)}" for m, c in zip(records["method"],
                                                                             records["context_len"])])
    lengths = [None, *sorted(records["context_len"].dropna().unique())]
    tables = []
    for family, frame, ctxs in ((MATCHED, records, lengths[:1]), (MATCHED_BY_LENGTH, tagged, lengths[1:])):
        rows, pairs = [], []
        for ctx in ctxs:
            sub = records if ctx is None else records[records["context_len"] == ctx]
            tag = "" if ctx is None else f" @{length_label(ctx)}"
            for budget in budgets:
                at_b = sub[sub["budget_pct"] == budget]
                reg = at_b[at_b["method"] == label]
                for method in token_methods:
                    tok = at_b[at_b["method"] == method]
                    if tok.empty:
                        continue
                    reg_t = reg[reg["case_id"].isin(tok["case_id"])]
                    row = {"length": "all" if ctx is None else length_label(ctx),
                           "context_len": float("nan") if ctx is None else float(ctx), "family": family.name,
                           "budget_pct": float(budget), "allocator": method.removesuffix(suffix),
                           "mean_tokens": float(tok["allowance"].mean()),
                           "mean_b": float(_region_allowance(reg_t, region).mean()), "n": int(len(tok)),
                           "unit": "pp"}
                    for metric in metrics:
                        row.update({f"{metric}_region": 100 * float(reg_t[metric].astype(float).mean()),
                                    f"{metric}_token": 100 * float(tok[metric].astype(float).mean())})
                    rows.append(row)
                    pairs.append((f"{label}{tag} {budget:g}%", f"{method}{tag} {budget:g}%"))
        table = pd.DataFrame(rows)
        for metric in metrics:
            res = _decided(frame, pairs, metric, family, decide=decide, n_boot=n_boot, seed=seed)
            for col in ("delta", "delta_low", "delta_high", "p_adj", "delta_mde", "verdict"):
                table[f"{metric}_{col}"] = res[col].to_numpy()
        tables.append(table)
    return pd.concat(tables, ignore_index=True)


# ---------------------------------------------------------------------------------------------------------------------
# SUR's design variants and the boundary controls, one factor at a time (appendix 9.3; issue 28)


def ablation_factor(method: str) -> tuple[str, str]:
    """``(factor, change)`` of an ablation method: a SUR factor (:data:`SUR_FACTORS`), appendix 9.3's joint arm, a
    boundary control (:data:`BOUNDARY_CONTROLS`), or ``("other", method)``."""
    for factor, paper, changed, name in SUR_FACTORS:
        if method == name:
            return factor, f"{paper} -> {changed}"
    if method == JOINT_ARM:
        return "9.3 joint arm", "mean + prefix + prompt"
    if method == "Fixed blocks":
        return "boundaries", "text units -> equal token blocks"
    if method == "Multiple local windows":
        return "boundaries", "text units -> windows around top tokens"
    return "other", method


def ablation_table(records: pd.DataFrame, *, metric: str = "em", reference: str = "SUR",
                   methods: Sequence[str] | None = None, n_boot: int = 10_000, seed: int = 20260928,
                   decide: bool = True) -> pd.DataFrame:
    """SUR's variants and the boundary controls against SUR, one factor at a time, case-paired at each budget.

    Every method changes one thing from ``reference`` (:func:`ablation_factor`) and runs on the same cases at the
    same budget. The controls and every variant but the whole-prompt allowance select exactly SUR's B positions
    (matched token counts); ``mean_tokens`` beside ``reference_tokens`` shows where the count differs. The rows are
    the :data:`ABLATION_FAMILY` on ``metric``, decided together (:func:`sur_lab.analysis.decisions.paired_family`:
    Holm over every (method, budget) row).

    Args:
        records: :meth:`STUDY.sweep` records holding ``reference`` and the methods.
        metric: a 0/1 or numeric record field (differences of a 0/1 field ×100, pp).
        reference: the method every row is compared with (the paper's SUR).
        methods: the methods to compare (default: those of :data:`ABLATION` present, in that order).
        n_boot, seed, decide: as :func:`paired_differences`.

    Returns:
        One row per (method, budget): ``method``, ``factor``, ``change``, ``budget_pct``, ``mean_tokens``,
        ``reference_tokens``, ``mean_intervals``, ``value`` and ``reference_value`` (mean ×100), ``delta``,
        ``delta_low``, ``delta_high``, ``unit``, ``n`` (cases), ``p_adj``, ``verdict`` (method minus SUR), then every
        other column of :func:`sur_lab.analysis.decisions.paired_family` and
        :func:`~sur_lab.analysis.decisions.in_units` (for :func:`~sur_lab.analysis.decisions.sentence`).

    Raises:
        ValueError: naming ``metric`` when it is not a record field, ``reference`` when it has no records, or
            ``records`` when a case of a method lacks SUR's row.
    """
    if metric not in records.columns:
        raise ValueError(f"metric={metric!r} is not a record field")
    if not (records["method"] == reference).any():
        raise ValueError(f"reference={reference!r} has no records")
    present = set(records["method"])
    methods = [m for m in ABLATION if m in present] if methods is None else list(methods)
    cols = ["method", "factor", "change", "budget_pct", "mean_tokens", "reference_tokens", "mean_intervals", "value",
            "reference_value", "delta", "delta_low", "delta_high", "unit", "n", "p_adj", "verdict"]
    rows, pairs = [], []
    for method in methods:
        arm_all = records[records["method"] == method]
        for budget in sorted(arm_all["budget_pct"].dropna().unique()):
            arm = arm_all[arm_all["budget_pct"] == budget]
            ref = records[(records["method"] == reference) & (records["budget_pct"] == budget)]
            ref = ref[ref["case_id"].isin(arm["case_id"])]
            if ref.empty:
                continue
            factor, change = ablation_factor(method)
            rows.append({"method": method, "factor": factor, "change": change, "budget_pct": float(budget),
                         "mean_tokens": float(arm["allowance"].mean()), "reference_tokens": float(ref["allowance"]
                                                                                                   .mean()),
                         "mean_intervals": float(arm["num_intervals"].mean()),
                         "value": 100 * float(arm[metric].astype(float).mean()),
                         "reference_value": 100 * float(ref[metric].astype(float).mean())})
            pairs.append((f"{method} {budget:g}%", f"{reference} {budget:g}%"))
    table = pd.DataFrame(rows, columns=cols[:9])
    if not pairs:
        return table.reindex(columns=cols)
    res = _decided(records, pairs, metric, ABLATION_FAMILY, decide=decide, n_boot=n_boot, seed=seed)
    return pd.concat([table, res[cols[9:] + [c for c in res.columns if c not in cols]]], axis=1)


# ---------------------------------------------------------------------------------------------------------------------
# Table 12: allocation geometry at a fixed relevance score

#: Table 12's rows (paper label -> allocator name).
TABLE12_RULES = {
    "SUR": "SUR",
    "Same-score tokens": "Dense tokens",
    "Single relevance window": "Max-relevance contiguous",
    "Same-unit BM25": "BM25 (same units)",
    "Random units": "Random semantic units",
}
#: Table 12 as published: strict EM (%) on 96 cases per model at 2 % and 5 %, rows in :data:`TABLE12_RULES` order.
PAPER_TABLE12 = {
    "Qwen3-8B": ((89.6, 99.0), (7.3, 14.6), (75.0, 86.5), (82.3, 94.8), (2.1, 5.2)),
    "Qwen3-30B": ((95.8, 96.9), (89.6, 91.7), (84.4, 79.2), (90.6, 94.8), (16.7, 17.7)),
    "Llama-70B": ((90.6, 99.0), (7.3, 8.3), (65.6, 72.9), (75.0, 94.8), (2.1, 5.2)),
    "GLM-Air": ((100.0, 100.0), (43.8, 57.3), (89.6, 88.5), (94.8, 100.0), (18.8, 19.8)),
    "Qwen3-235B": ((97.9, 100.0), (83.3, 91.7), (72.9, 77.1), (99.0, 100.0), (78.1, 83.3)),
}


def paper_table12() -> "pd.DataFrame":
    """Table 12 as a DataFrame: rows are allocator names, columns ``(model, "2%"|"5%")``, values EM %."""
    import pandas as pd

    cols = pd.MultiIndex.from_product([list(PAPER_TABLE12), ["2%", "5%"]], names=["model", "budget"])
    rows = [[PAPER_TABLE12[m][i][j] for m in PAPER_TABLE12 for j in range(2)] for i in range(len(TABLE12_RULES))]
    return pd.DataFrame(rows, index=list(TABLE12_RULES.values()), columns=cols)


def table12(
    records: "pd.DataFrame", value: str = "agree_reprefill", budgets: Sequence[float] = (2, 5)
) -> "pd.DataFrame":
    """Our Table 12: mean ``value`` (×100) of the five allocation rules at ``budgets``, rows in paper order.

    Raises:
        ValueError: naming ``records`` when a rule or budget is missing.
    """
    rows = list(TABLE12_RULES.values())
    df = records[records["method"].isin(rows) & records["budget_pct"].isin([float(b) for b in budgets])]
    table = df.assign(_v=df[value].astype(float) * 100).pivot_table(
        index="method", columns="budget_pct", values="_v", aggfunc="mean"
    )
    missing = [r for r in rows if r not in table.index] + [b for b in budgets if float(b) not in table.columns]
    if missing:
        raise ValueError(f"records lack {missing} for Table 12")
    table = table.loc[rows, [float(b) for b in budgets]]
    table.columns = [f"{b:g}%" for b in budgets]
    return table


def order_concordance(ours: Sequence[float], paper: Sequence[float]) -> tuple[int, int, int]:
    """Pairwise ordering agreement between two score lists over the same rules.

    Returns:
        ``(concordant, discordant, tied)`` rule pairs; a pair tied in either list counts as tied.

    Raises:
        ValueError: if the lengths differ.
    """
    if len(ours) != len(paper):
        raise ValueError(f"ours has {len(ours)} scores and paper {len(paper)}")
    con = dis = tie = 0
    for i in range(len(ours)):
        for j in range(i + 1, len(ours)):
            a, b = np.sign(ours[i] - ours[j]), np.sign(paper[i] - paper[j])
            if a == 0 or b == 0:
                tie += 1
            elif a == b:
                con += 1
            else:
                dis += 1
    return con, dis, tie


def table12_concordance(ours: "pd.DataFrame") -> "pd.DataFrame":
    """For each budget column of ``ours`` (from :func:`table12`) and each paper model: concordant / discordant / tied
    rule pairs against the published Table 12 (10 pairs of 5 rules)."""
    import pandas as pd

    paper = paper_table12()
    rows = []
    for budget in ours.columns:
        for model in PAPER_TABLE12:
            con, dis, tie = order_concordance(ours[budget].tolist(), paper[(model, budget)].tolist())
            rows.append({"budget": budget, "paper_model": model, "concordant": con, "discordant": dis, "tied": tie})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Tables and figures (Tables 2-6, Figure 3)


def budget_table(records: pd.DataFrame, value: str = "agree_reprefill", *, scale: float = 100.0) -> pd.DataFrame:
    """Method × budget table of the mean of ``value`` (×``scale``), references in a ``"Reference"`` column
    (Tables 2–6).

    Rows follow :data:`REFERENCES` then :data:`PAPER_ALLOCATORS` order (others after), for the methods present.

    Raises:
        ValueError: if ``value`` is not a column of ``records``.
    """
    if value not in records.columns:
        raise ValueError(f"value={value!r} is not a record field; fields: {', '.join(records.columns)}")
    df = records.assign(_v=records[value].astype(float) * scale)
    is_ref = df["budget_pct"].isna()
    table = df[~is_ref].pivot_table(index="method", columns="budget_pct", values="_v", aggfunc="mean")
    table.columns = [f"{b:g}%" for b in table.columns]
    refs = df[is_ref].groupby("method")["_v"].mean().rename("Reference")
    table = pd.concat([refs, table], axis=1)
    order = [m for m in REFERENCES + PAPER_ALLOCATORS if m in table.index]
    order += [m for m in table.index if m not in order]
    return table.loc[order]


def paired_differences(
    records: pd.DataFrame,
    *,
    metric: str = "em",
    baselines: Sequence[str] = ("Shift", "Re-prefill"),
    methods: Sequence[str] | None = None,
    n_boot: int = 10_000,
    seed: int = 20260928,
    decide: bool = True,
) -> pd.DataFrame:
    """Each budgeted method minus each baseline reference, case-paired, in percentage points: the
    :data:`ALL_AGAINST_REFERENCES` family (the figure of notebook 02), decided together.

    Every (method, budget) row of ``records`` is compared with the same cases' rows of each baseline by
    :func:`sur_lab.analysis.decisions.paired_family` (a 0/1 metric: exact sign test on the discordant cases and
    Newcombe's interval; a numeric one: percentile bootstrap and sign-flip test), Holm over every row.

    Args:
        records: sweep records (one row per case × method × budget), with ``case_id``, ``method``, ``budget_pct``
            (NaN for references) and ``metric``.
        metric: a 0/1 or numeric record field (``"em"``, ``"agree_reprefill"``); 0/1 differences are ×100 (pp).
        baselines: reference methods to compare against, in this order; those absent from ``records`` are skipped.
        methods: budgeted methods to compare (default: all present, in record order).
        n_boot, seed: bootstrap replicates and sign-flip resamples (>= 100), generator seed.
        decide: ``False`` at a plumbing-check size (:func:`sur_lab.analysis.decisions.decides`).

    Returns:
        One row per (method, budget_pct, baseline): ``delta``, ``delta_low``, ``delta_high``, ``unit`` ("pp" for a
        0/1 metric), ``n`` (cases), ``p_adj``, ``verdict``, then every other column of
        :func:`sur_lab.analysis.decisions.paired_family` and :func:`~sur_lab.analysis.decisions.in_units`.

    Raises:
        ValueError: naming ``metric`` when it is not a record field, or ``records`` when a case of a method lacks
            the baseline's row.
    """
    if metric not in records.columns:
        raise ValueError(f"metric={metric!r} is not a record field; fields: {', '.join(records.columns)}")
    is_ref = records["budget_pct"].isna()
    budgeted = records[~is_ref]
    if methods is None:
        methods = list(dict.fromkeys(budgeted["method"]))
    bases = [base for base in baselines if (is_ref & (records["method"] == base)).any()]
    rows, pairs = [], []
    for method in methods:
        for budget in sorted(budgeted.loc[budgeted["method"] == method, "budget_pct"].unique()):
            for base in bases:
                rows.append({"method": method, "budget_pct": float(budget), "baseline": base})
                pairs.append((f"{method} {budget:g}%", base))
    cols = ["method", "budget_pct", "baseline", "delta", "delta_low", "delta_high", "unit", "n", "p_adj", "verdict"]
    table = pd.DataFrame(rows, columns=cols[:3])
    if not pairs:
        return table.reindex(columns=cols)
    res = _decided(records, pairs, metric, ALL_AGAINST_REFERENCES, decide=decide, n_boot=n_boot, seed=seed)
    return pd.concat([table, res[cols[3:] + [c for c in res.columns if c not in cols]]], axis=1)


def family_pairs(records: pd.DataFrame, family: Family, *, focus: str = "SUR") -> list[tuple[str, str]]:
    """The comparisons ``(a, b)`` (arm labels, :func:`sur_lab.analysis.conclusions.arm_labels`) that ``family``
    (:data:`PRIMARY`, :data:`RIVALS` or :data:`BEYOND`) holds in ``records``: its rule applied to the methods and
    budgets that ran (absent arms are left out).

    Raises:
        ValueError: naming ``family`` when it is not one of the three.
    """
    from sur_lab.analysis.conclusions import arm_labels

    if family not in (PRIMARY, RIVALS, BEYOND):
        raise ValueError(f"family={family.name!r}: family_pairs knows PRIMARY, RIVALS and BEYOND")
    arms = set(arm_labels(records))
    budgets = sorted(records.loc[(records["method"] == focus) & records["budget_pct"].notna(), "budget_pct"].unique())
    budgets = [b for b in budgets if b in FAMILY_BUDGETS] or budgets
    primary = (f"{focus} {PRIMARY_BUDGET:g}%", "Shift")
    candidates = [primary] if family == PRIMARY else []
    for b in budgets if family != PRIMARY else ():
        at = f"{focus} {b:g}%"
        if family == RIVALS:
            candidates += [(at, r) for r in ("Shift", "Re-prefill") if (at, r) != primary]
            candidates += [(at, f"{m} {b:g}%") for m in PAPER_ALLOCATORS if m != focus]
        else:
            candidates += [(f"{m} {b:g}%" if m != "Erratum" else m, at) for m in BEYOND_PAPER]
    return [p for p in candidates if p[0] in arms and p[1] in arms]


def decide_families(records: pd.DataFrame, *, metric: str, decide: bool = True, n_boot: int = 10_000,
                    seed: int = 20260928) -> pd.DataFrame:
    """Notebook 02's primary comparison and its secondary families :data:`RIVALS` and :data:`BEYOND`, on ``metric``
    (the lead endpoint), each decided as declared (:func:`sur_lab.analysis.decisions.paired_family`; the ablation
    family is :func:`ablation_table`'s).

    Args:
        records: :meth:`STUDY.sweep` records.
        metric: the lead endpoint (a 0/1 record field).
        decide: ``False`` at a plumbing-check size (``decisions.decides(preset)``).
        n_boot, seed: as :func:`paired_differences`.

    Returns:
        :func:`sur_lab.analysis.decisions.paired_family` rows of the three families (``family`` names each), with
        the columns of :func:`sur_lab.analysis.decisions.in_units`.
    """
    parts = [_decided(records, pairs, metric, fam, decide=decide, n_boot=n_boot, seed=seed)
             for fam in (PRIMARY, RIVALS, BEYOND) if (pairs := family_pairs(records, fam))]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["family", "verdict"])


def conclusion(records: pd.DataFrame, decided: pd.DataFrame, *, metric: str, allocators: Sequence[str],
               decide: bool = True, n_boot: int = 10_000, seed: int = 20260928) -> list[str]:
    """The generated conclusion's verdict lines: at each budget the allocator with the highest point estimate on
    ``metric`` with the selection named (:func:`sur_lab.analysis.decisions.best_of`), then the primary comparison
    and every comparison of the secondary families (:func:`decide_families`), each naming its family and size.

    Args:
        records: :meth:`STUDY.sweep` records.
        decided: :func:`decide_families` of the same records.
        metric: the lead endpoint; allocators: the budgeted methods ranked (those that ran).
        decide, n_boot, seed: as :func:`decide_families`.
    """
    from sur_lab.analysis.conclusions import arm_labels
    from sur_lab.analysis.decisions import best_of, family_lines

    df = records.assign(arm=arm_labels(records))
    lines = []
    for b in sorted(records.loc[records["method"].isin(allocators), "budget_pct"].dropna().unique()):
        at = df[(df["budget_pct"] == b) & df["method"].isin(allocators)]
        wide = at.pivot(index="case_id", columns="method", values=metric).astype(float)
        lines.append(f"At {b:g} %: " + best_of({m: wide[m].to_numpy() for m in allocators if m in wide.columns},
                                                kind="binary", what="allocators", decide=decide, n_boot=n_boot,
                                                seed=seed))
    if decided.empty:
        return lines + ["No declared comparison ran (the primary needs SUR at 5 % and Shift)."]
    return lines + family_lines(decided)


#: Line styles of the reference operators in budget curves.
REFERENCE_STYLES = {
    "Dirty": ("tab:red", "--"), "Shift": ("0.45", ":"), "Replay": ("tab:blue", "-."), "Re-prefill": ("tab:green", "--"),
}
#: Record fields shown as percentages of cases.
PERCENT_FIELDS = ("em", "agree_reprefill")


def plot_budget_curves(
    records: pd.DataFrame,
    metrics: Sequence[str],
    titles: Sequence[str] | None = None,
    *,
    agg: str | Mapping[str, str] = "mean",
):
    """Budget–quality curves (Figure 3 style): one panel per metric, one line per allocator aggregated over cases
    (SUR drawn thick and black), references as horizontal lines, log-scaled budget axis.

    Boolean endpoints (:data:`PERCENT_FIELDS`) are shown in percent. ``agg`` is a pandas aggregation name for every
    metric or per metric (e.g. ``{"nr_tv": "median"}``: Eq. 14 ratios are unbounded below, and the paper reports
    medians of the defined ones); missing metrics default to the mean.

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: naming ``metrics`` when a metric is not a record field.
    """
    import matplotlib.pyplot as plt

    missing = [m for m in metrics if m not in records.columns]
    if missing:
        raise ValueError(f"metrics {missing} are not record fields")
    titles = list(titles or metrics)
    alloc = records[records["budget_pct"].notna()]
    refs = records[records["budget_pct"].isna()]
    order, palette = _allocator_palette(alloc)
    budgets = sorted(alloc["budget_pct"].unique())
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics) + 2.4, 4.0), squeeze=False)
    for ax, metric, title in zip(axes[0], metrics, titles):
        how = agg if isinstance(agg, str) else agg.get(metric, "mean")
        _budget_panel(ax, alloc, refs, metric, order, palette, budgets, how=how)
        ax.set_title(title)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_paired_differences(table: pd.DataFrame, *, metric_label: str = "strict EM"):
    """Forest plot of :func:`paired_differences`: one panel per baseline, one row per (method, budget), the observed
    difference (in the table's ``unit``) with its 95 % interval; filled markers are the differences the family decides ("beats" or
    "loses to" after Holm over the family).

    Args:
        table: the output of :func:`paired_differences` (non-empty).
        metric_label: the compared endpoint's name for the axis label.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: if ``table`` is empty.
    """
    import matplotlib.pyplot as plt

    if table.empty:
        raise ValueError("table is empty: no (method, budget, baseline) pair to plot")
    baselines = list(dict.fromkeys(table["baseline"]))
    labels = list(dict.fromkeys(f"{m} {b:g}%" for m, b in zip(table["method"], table["budget_pct"])))
    fig, axes = plt.subplots(1, len(baselines), figsize=(5.2 * len(baselines), 0.32 * len(labels) + 1.4),
                             sharey=True, squeeze=False)
    for ax, base in zip(axes[0], baselines):
        sub = table[table["baseline"] == base]
        y = [labels.index(f"{m} {b:g}%") for m, b in zip(sub["method"], sub["budget_pct"])]
        err = [sub["delta"] - sub["delta_low"], sub["delta_high"] - sub["delta"]]
        ax.errorbar(sub["delta"], y, xerr=err, fmt="none", ecolor="0.4", capsize=3)
        sep = sub["verdict"].isin(SEPARATED).to_numpy(bool)
        ax.scatter(sub["delta"][sep], [v for v, k in zip(y, sep) if k], color="tab:blue", zorder=3,
                   label="separated (Holm over the family)")
        ax.scatter(sub["delta"][~sep], [v for v, k in zip(y, sep) if not k], facecolor="white",
                   edgecolor="tab:blue", zorder=3, label="not separated or not decided")
        ax.axvline(0, color="0.2", lw=0.8)
        ax.set_title(f"minus {base}")
        unit = str(sub["unit"].iloc[0]) if "unit" in sub.columns and len(sub) else "pp"
        ax.set_xlabel(f"{metric_label} difference ({unit + ', ' if unit else ''}95 % CI)")
        ax.set_yticks(range(len(labels)), labels)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def plot_intervals(records: pd.DataFrame):
    """Distribution of interval counts R per allocator and budget (box plots, log scale); returns the figure."""
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    alloc = records[records["budget_pct"].notna()].copy()
    alloc["budget"] = [f"{b:g}%" for b in alloc["budget_pct"]]
    present = list(dict.fromkeys(alloc["method"]))
    order = [m for m in PAPER_ALLOCATORS if m in present] + [m for m in present if m not in PAPER_ALLOCATORS]
    hue_order = [f"{b:g}%" for b in sorted(alloc["budget_pct"].unique())]
    fig, ax = plt.subplots(figsize=(11, 4.6))
    sns.boxplot(data=alloc, x="method", y="num_intervals", hue="budget", order=order, hue_order=hue_order, ax=ax,
                fliersize=2, linewidth=0.8, palette="crest")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("intervals R")
    ax.set_xlabel("")
    ax.tick_params(axis="x", rotation=60, labelsize=8)
    ax.legend(title="budget", fontsize=8, ncol=len(hue_order))
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------------------------
# Across models: Figure 3 one panel per model, Tables 2-6 stacked (issue 28)


def combine(folders: Sequence[Path | str]) -> pd.DataFrame:
    """The records of several NIAH sweep folders, one model each, as one table for the cross-model figure and tables.

    Each folder is read from its ``records.parquet`` (:func:`sur_lab.sweeps.store.read_records`). The folders must
    differ only in the model: every configuration fingerprint field outside :data:`~sur_lab.sweeps.record.MODEL_FIELDS` (seed, executor,
    decoding limit and rule, evaluation batch, allocator options, versions) must hold one value, the same in every
    folder, and the folders must hold the same case ids (the same roster, tokenized by each model: the case
    fingerprints differ) and the same (method, budget) grid, as every panel of Figure 3 uses the same cases and
    methods.

    Args:
        folders: two or more sweep folders (e.g. notebook 02's or ``sur-lab sweep niah``'s, one per model).

    Returns:
        The concatenated records, in folder order (the ``model`` column tells them apart).

    Raises:
        ValueError: naming ``folders`` when fewer than one is given or two name the same folder, a folder that holds
            more than one model or the same model as another, or a field whose value differs (the first differing
            field and the two folders), a case roster or method grid that differs.
        FileNotFoundError: for a folder without ``records.parquet`` (its sweep has not finished).
    """
    from sur_lab.sweeps.record import CONFIG_FIELDS, MODEL_FIELDS
    from sur_lab.sweeps.store import read_records

    paths = [Path(f) for f in folders]
    if not paths:
        raise ValueError("folders is empty: give one sweep folder per model")
    if len({p.resolve() for p in paths}) != len(paths):
        raise ValueError(f"folders repeat a folder: {[str(p) for p in paths]}")
    frames = [read_records(p) for p in paths]
    shared = [f for f in CONFIG_FIELDS if f not in MODEL_FIELDS]
    first, first_path = frames[0], paths[0]
    seen_models: dict[str, Path] = {}
    for path, df in zip(paths, frames):
        models = sorted(set(df["model_weights"]))
        if len(models) != 1:
            raise ValueError(f"folders: {path} holds {len(models)} models ({sorted(set(df['model']))}); one per folder")
        if models[0] in seen_models:
            raise ValueError(f"folders: {path} and {seen_models[models[0]]} hold the same model "
                             f"({df['model'].iloc[0]})")
        seen_models[models[0]] = path
        for name in shared:
            values = sorted(set(map(str, df[name])))
            if len(values) != 1:
                raise ValueError(f"folders: {path} holds several values of {name!r} ({values})")
            ref = str(first[name].iloc[0])
            if values[0] != ref:
                raise ValueError(f"folders: {name!r} differs between {first_path} ({ref!r}) and {path} "
                                 f"({values[0]!r}); only the model ({', '.join(MODEL_FIELDS)}) may differ")
        if set(df["case_id"]) != set(first["case_id"]):
            raise ValueError(f"folders: {path} and {first_path} hold different cases; every panel needs the same "
                             "roster")
        grid = {(m, "ref" if pd.isna(b) else float(b)) for m, b in zip(df["method"], df["budget_pct"])}
        first_grid = {(m, "ref" if pd.isna(b) else float(b)) for m, b in zip(first["method"], first["budget_pct"])}
        if grid != first_grid:
            raise ValueError(f"folders: {path} and {first_path} hold different (method, budget) grids: "
                             f"{sorted(map(str, grid ^ first_grid))[:6]}")
    return pd.concat(frames, ignore_index=True)


def stacked_budget_tables(records: pd.DataFrame, value: str = "em", *, scale: float = 100.0) -> pd.DataFrame:
    """Tables 2-6 stacked: :func:`budget_table` per model, indexed by ``(model, method)`` in the models' order of
    appearance.

    Raises:
        ValueError: as :func:`budget_table`.
    """
    models = list(dict.fromkeys(records["model"]))
    return pd.concat({m: budget_table(records[records["model"] == m], value, scale=scale) for m in models},
                     names=["model", "method"])


def plot_model_panels(records: pd.DataFrame, metric: str = "em", *, title: str | None = None):
    """Figure 3 across models: one panel per model (order of appearance), one line per allocator over the budgets
    (SUR thick and black), the reference operators as horizontal lines, shared allocator colours.

    Returns:
        The matplotlib figure.

    Raises:
        ValueError: naming ``metric`` when it is not a record field.
    """
    import matplotlib.pyplot as plt

    if metric not in records.columns:
        raise ValueError(f"metric={metric!r} is not a record field")
    models = list(dict.fromkeys(records["model"]))
    alloc_all = records[records["budget_pct"].notna()]
    order, palette = _allocator_palette(alloc_all)
    budgets = sorted(alloc_all["budget_pct"].unique())
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 2.4, 4.0), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        sub = records[records["model"] == model]
        alloc, refs = sub[sub["budget_pct"].notna()], sub[sub["budget_pct"].isna()]
        _budget_panel(ax, alloc, refs, metric, order, palette, budgets, how="mean")
        ax.set_title(f"{model} (n = {sub['case_id'].nunique()})")
    axes[0][0].set_ylabel(title or metric)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _budget_panel(ax, alloc: pd.DataFrame, refs: pd.DataFrame, metric: str, order: Sequence[str],
                  palette: Mapping[str, Any], budgets: Sequence[float], *, how: str = "mean") -> None:
    """One Figure-3 panel: ``metric`` (×100 for a 0/1 field) aggregated by ``how`` per allocator and budget, a line
    per allocator of ``order`` present in ``alloc`` (SUR thick), each reference of ``refs`` a horizontal line; the
    budget axis logarithmic when there are several budgets."""
    from matplotlib.ticker import NullFormatter

    scale = 100.0 if metric in PERCENT_FIELDS else 1.0
    curve = alloc.assign(_v=alloc[metric].astype(float) * scale).groupby(["method", "budget_pct"])["_v"].agg(how)
    for method in [m for m in order if m in curve.index.get_level_values(0)]:
        c = curve.loc[method]
        ax.plot(c.index, c.values, marker="o", ms=4, color=palette[method], label=method,
                lw=2.8 if method == "SUR" else 1.2, zorder=3 if method == "SUR" else 2)
    ref_means = refs.assign(_v=refs[metric].astype(float) * scale).groupby("method")["_v"].agg(how)
    for method in [m for m in REFERENCES if m in ref_means.index]:
        color, style = REFERENCE_STYLES[method]
        ax.axhline(ref_means[method], color=color, ls=style, lw=1.3, label=f"{method} (reference)")
    if len(budgets) > 1:
        ax.set_xscale("log")
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if scale == 100.0:
        ax.set_ylim(-4, 104)
    ax.set_xlabel("suffix budget b (%)")


def _allocator_palette(alloc: pd.DataFrame) -> tuple[list[str], dict[str, Any]]:
    """The allocators of ``alloc`` in Table 2-6 order (others after, in order of appearance) and one colour each
    (SUR black, the others from seaborn's ``tab20``), shared by every Figure-3 panel."""
    import seaborn as sns

    present = list(dict.fromkeys(alloc["method"]))
    order = [m for m in PAPER_ALLOCATORS if m in present] + [m for m in present if m not in PAPER_ALLOCATORS]
    others = [m for m in order if m != "SUR"]
    return order, dict(zip(others, sns.color_palette("tab20", max(1, len(others)))), SUR="black")


# ---------------------------------------------------------------------------------------------------------------------
# Notebook 02's report: one function per table, figure or printout (issue 39)

#: The endpoints' printed names in notebook 02's tables and figures.
ENDPOINT_LABELS = {"em": "strict EM (%)", "agree_reprefill": "agreement with Re-prefill (%)",
                   "tv_reprefill": "first-token TV to Re-prefill"}


def geometry_table(records: pd.DataFrame, budgets: Sequence[float]) -> pd.DataFrame:
    """Table 12 on four endpoints side by side: agreement and strict EM (%), mean first-token TV and mean interval
    count R of the five allocation rules at ``budgets`` (:func:`table12` of each).

    Returns:
        Rows are allocator names (paper order), columns ``(endpoint, "2%"|"5%")``: ``"agreement (%)"``, ``"strict EM
        (%)"``, ``"mean TV"``, ``"mean R"``.

    Raises:
        ValueError: as :func:`table12`.
    """
    return pd.concat({"agreement (%)": table12(records, "agree_reprefill", budgets),
                      "strict EM (%)": table12(records, "em", budgets),
                      "mean TV": table12(records, "tv_reprefill", budgets) / 100,
                      "mean R": table12(records, "num_intervals", budgets) / 100}, axis=1)


def plot_budget_heatmap(agree: pd.DataFrame, em: pd.DataFrame):
    """Tables 2–6 as two heatmaps side by side: agreement with Re-prefill and strict EM (%) of every method at every
    budget (:func:`budget_table` of each; references in their ``"Reference"`` column). Returns the figure."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, axes = plt.subplots(1, 2, figsize=(13, 0.42 * len(agree) + 1.5), sharey=True)
    for ax, table, title in zip(axes, [agree, em], ["agreement with Re-prefill (%)", "strict EM (%)"]):
        sns.heatmap(table, annot=True, fmt=".0f", cmap="viridis", vmin=0, vmax=100, cbar=False, ax=ax,
                    annot_kws={"fontsize": 8})
        ax.set_title(title)
        ax.set_xlabel("budget")
        ax.set_ylabel("")
        ax.grid(False)
    fig.tight_layout()
    return fig


def selection_cost(records: pd.DataFrame, allocators: Sequence[str]) -> pd.DataFrame:
    """Support geometry and selection cost per allocator over its budgeted records: ``median_R`` (intervals),
    ``extra_forward_tokens`` (mean), ``extra_forward_layers`` (max), ``select_ms`` and ``refresh_ms`` (medians),
    ``median_nr_tv``, ``mean_nll`` (of Re-prefill's continuation, nats); one row per allocator in ``allocators``'
    order, ``method`` a column.

    Raises:
        ValueError: naming ``allocators`` when one has no budgeted record.
    """
    alloc = records[records["budget_pct"].notna()]
    missing = [m for m in allocators if m not in set(alloc["method"])]
    if missing:
        raise ValueError(f"allocators {missing} have no budgeted record")
    cost = alloc.groupby("method").agg(
        median_R=("num_intervals", "median"), extra_forward_tokens=("extra_forward_tokens", "mean"),
        extra_forward_layers=("extra_forward_layers", "max"), select_ms=("select_ms", "median"),
        refresh_ms=("refresh_ms", "median"), median_nr_tv=("nr_tv", "median"),
        mean_nll=("nll_reprefill", "mean")).loc[list(allocators)]
    return cost.reset_index()


def ablation(records: pd.DataFrame, *, metrics: Sequence[str], methods: Sequence[str], decide: bool = True,
             n_boot: int = 10_000, seed: int = 20260928) -> pd.DataFrame:
    """:func:`ablation_table` of each of ``metrics`` (duplicates dropped), stacked with a ``metric`` column: the
    ablation family decided per endpoint (Holm within each)."""
    return pd.concat([ablation_table(records, metric=m, methods=methods, decide=decide, n_boot=n_boot,
                                     seed=seed).assign(metric=m) for m in dict.fromkeys(metrics)],
                     ignore_index=True)


def table14_lines(table: pd.DataFrame, *, region: str = "SUR", count: str = "whole_units") -> list[str]:
    """Table 14 in words, per family (:data:`MATCHED`, :data:`MATCHED_BY_LENGTH`): a heading naming its size, then per
    row the length, budget, mean matched count and B, and per endpoint the region minus token difference with its
    interval, adjusted p, the smallest separable difference and the verdict.

    Args:
        table: :func:`table14`.
        region, count: the region arm (:func:`region_label`).
    """
    arm = region_label(region, count)
    lines = []
    for family in (MATCHED, MATCHED_BY_LENGTH):
        rows = table[table["family"] == family.name]
        lines.append(f"This run ({family.name}, Holm over {len(rows)} comparisons per endpoint):")
        for row in rows.itertuples():
            parts = []
            for m, name in (("em", "EM"), ("agree_reprefill", "agreement")):
                get = lambda col: getattr(row, f"{m}_{col}")  # noqa: E731
                mde = (f"{get('delta_mde'):.0f} {row.unit}" if get("delta_mde") <= 100 else "none at this size")
                parts.append(f"{name} {get('delta'):+.1f} {row.unit} (95 % CI {get('delta_low'):+.1f} to "
                             f"{get('delta_high'):+.1f}, p_adj {get('p_adj'):.2g}, smallest separable {mde}): "
                             f"{get('verdict')}")
            lines.append(f"  {row.length}, {row.budget_pct:g} % (mean n {row.mean_tokens:.1f} matched tokens, mean B "
                         f"{row.mean_b:.1f}), {arm} minus {row.allocator} over {row.n} case(s): " + "; ".join(parts))
    return lines


def reference_line(records: pd.DataFrame, references: Sequence[str], metric: str) -> str:
    """The references' mean ``metric`` (%) in words: ``"References (strict EM): Shift 40 %, Re-prefill 100 %."``"""
    label = ENDPOINT_LABELS.get(metric, metric).removesuffix(" (%)")
    refs = records[records["method"].isin(references)].groupby("method")[metric].mean().mul(100)
    return f"References ({label}): " + ", ".join(f"{m} {refs[m]:.0f} %" for m in references if m in refs) + "."


def concordance_line(concordance: pd.DataFrame) -> str:
    """:func:`table12_concordance` summed over the paper's models, per budget, in words."""
    c = concordance.groupby("budget")[["concordant", "discordant", "tied"]].sum()
    return ("Table 12 ordering against the paper's, pairs summed over its five models: " + "; ".join(
        f"{b}: {r.concordant} concordant, {r.discordant} discordant, {r.tied} tied" for b, r in c.iterrows()) + ".")
