"""Non-prefix reuse: composing independently cached documents into one KV cache (SAFE-KV, Figure 1).

A RAG prompt is ``P ⊕ D_0 ⊕ ... ⊕ D_{n-1} ⊕ Q``: a shared instruction prefix P (p tokens, chat-template head and
instruction), n documents and the query Q (question and template tail). *Full prefill* (Fig. 1a) encodes every
document under its true history. *Prefix-conditioned composition* (Fig. 1b) reuses per-document caches that were
computed once, each under the prefix P alone, at positions ``p .. p + L_i - 1``; to place document i at its position
in this prompt its keys are re-rotated by ``delta_i = start_i`` positions (RoPE composes additively, Eq. 2), and the
prefix rows and the re-positioned document rows are concatenated. Positions are then exact, but every document after
the first lacks its predecessors in its history, so its K/V rows (and the query's answer) can drift.

The shared prefix is prefilled once and reused by every path (ordinary prefix caching), so full prefill, composition
and every repair differ only in how the document rows were obtained. Consequences that the tests check exactly in
float64: composing one document is bitwise the full prefill (``delta_0 = 0``), and re-encoding every document row
after the prefix (suffix repair from the first document) reproduces the full prefill bitwise.

Token ids. A document cache store tokenizes each document on its own, so the prompt's token ids are the concatenation
of the segments' ids (prefix, each document block with its trailing blank line, query). This can differ from tokenizing
the whole rendered text at a few segment boundaries (a blank line before ``Title`` is one token here, two there); full
prefill uses exactly the same concatenated ids, so the reference is "full prefill of the exact prompt".

Bridge to the deletion executors (one operator for both scenarios): :func:`composition_edit` expresses the composed
prompt as an :class:`~sur_lab.edits.EditedContext` whose *prefix* is P and whose *suffix* is the composed documents,
so a repair unit is a :class:`~sur_lab.budget.Support` over the ``S = sum_i L_i`` document positions and any registered
executor (``get_executor("sequential")``, packed ones when present) recomputes it from the composed cache exactly as it
recomputes a support of a Shift cache after a deletion.

Source: SAFE-KV (Zhang, 2026), Figure 1 and abstract; RoPE re-rotation: Eq. 2 and appendix 7.1 of the budgeted
repair paper.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from sur_lab.cache_ops import (
    cache_length,
    clone_cache,
    from_tensors,
    rerotate_keys,
    slice_rows,
    to_tensors,
)
from sur_lab.checks import as_token_ids
from sur_lab.data.text import truncate_text
from sur_lab.edits import DEFAULT_INSTRUCTION, EditedContext, render_chat
from sur_lab.forward import forward_tokens, prefill
from sur_lab.models import LoadedModel
from sur_lab.fingerprint import model_fingerprint

#: Separator after each document block; the query segment starts right after the last one.
DOC_SEPARATOR = "\n\n"
#: Token id of the one-token "deleted span" placeholder in :func:`composition_edit` (never forwarded by executors).
PLACEHOLDER_TOKEN = 0


def _as_ids(x, name: str) -> torch.Tensor:
    # Refused, not reinterpreted: a [2, N] batch is not flattened, float ids are not truncated (issue 12, kind 5).
    return as_token_ids(x, name)


@dataclass(frozen=True)
class ComposedPrompt:
    """A RAG prompt ``P ⊕ D_0 ⊕ ... ⊕ D_{n-1} ⊕ Q`` split into separately tokenized segments.

    Attributes:
        prefix_ids: ``[p]`` int64, the shared instruction prefix P (p >= 1).
        doc_ids: n >= 1 tensors ``[L_i]`` int64, each document block with its trailing separator.
        query_ids: ``[Q]`` int64, question plus chat-template tail.
        question: relevance query text (``None`` for token-level prompts).
        question_ids: ``[|q|]`` int64 relevance query for query-guided selection and SUR (defaults to ``query_ids``).
        supporting: per document, whether it is gold evidence (all False when unknown).
        titles: per document title ("" when unknown).
        prefix_text / doc_texts / query_text: the segments' text (``None`` for token-level prompts).
        offsets: ``(start, end)`` character spans in ``prefix_text + "".join(doc_texts)`` of the ``p + S`` pre-query
            tokens (``None`` for token-level prompts); SUR's semantic units use them.
        containers: ``(start, end, kind)`` message containers in the same text (appendix 7.3).

    Raises:
        ValueError: (at construction) naming ``documents`` when there are none, ``doc_ids`` when one is empty,
            ``prefix_ids``/``query_ids`` when empty, ``supporting``/``titles`` when their length is not n.
    """

    prefix_ids: torch.Tensor
    doc_ids: tuple[torch.Tensor, ...]
    query_ids: torch.Tensor
    question: str | None = None
    question_ids: torch.Tensor | None = None
    supporting: tuple[bool, ...] = ()
    titles: tuple[str, ...] = ()
    prefix_text: str | None = None
    doc_texts: tuple[str, ...] | None = None
    query_text: str | None = None
    offsets: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    containers: tuple[tuple[int, int, str], ...] = ()

    def __post_init__(self) -> None:
        if len(self.doc_ids) == 0:
            raise ValueError("documents is empty; a composed prompt needs at least one document")
        object.__setattr__(self, "prefix_ids", _as_ids(self.prefix_ids, "prefix_ids"))
        object.__setattr__(self, "query_ids", _as_ids(self.query_ids, "query_ids"))
        object.__setattr__(self, "doc_ids", tuple(_as_ids(d, f"doc_ids[{i}]") for i, d in enumerate(self.doc_ids)))
        if self.question_ids is not None:
            object.__setattr__(self, "question_ids", _as_ids(self.question_ids, "question_ids"))
        n = len(self.doc_ids)
        if not self.supporting:
            object.__setattr__(self, "supporting", (False,) * n)
        if not self.titles:
            object.__setattr__(self, "titles", ("",) * n)
        if len(self.supporting) != n:
            raise ValueError(f"supporting has {len(self.supporting)} entries; there are {n} documents")
        if len(self.titles) != n:
            raise ValueError(f"titles has {len(self.titles)} entries; there are {n} documents")
        if self.offsets is not None and len(self.offsets) != self.prefix_len + self.suffix_len:
            raise ValueError(f"offsets has {len(self.offsets)} entries; the pre-query tokens are p + S")

    @property
    def num_docs(self) -> int:
        """n, documents."""
        return len(self.doc_ids)

    @property
    def prefix_len(self) -> int:
        """p, tokens of the shared prefix."""
        return int(self.prefix_ids.numel())

    @property
    def doc_lens(self) -> np.ndarray:
        """``[n]`` int64, tokens per document L_i."""
        return np.array([int(d.numel()) for d in self.doc_ids], dtype=np.int64)

    @property
    def doc_starts(self) -> np.ndarray:
        """``[n]`` int64, suffix-local start of each document (``delta_i`` of its re-rotation)."""
        lens = self.doc_lens
        return np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)

    @property
    def doc_bounds(self) -> list[tuple[int, int]]:
        """Half-open suffix-local ``(start, end)`` of each document."""
        return [(int(a), int(a + n)) for a, n in zip(self.doc_starts, self.doc_lens)]

    @property
    def suffix_len(self) -> int:
        """S = sum_i L_i, document tokens after the prefix (the reused region)."""
        return int(self.doc_lens.sum())

    @property
    def doc_index(self) -> np.ndarray:
        """``[S]`` int64, the document each suffix position belongs to."""
        return np.repeat(np.arange(self.num_docs, dtype=np.int64), self.doc_lens)

    @property
    def ids(self) -> torch.Tensor:
        """``[p + S]`` int64, the pre-query tokens ``P ⊕ D_0 ⊕ ... ⊕ D_{n-1}``."""
        return torch.cat((self.prefix_ids, *self.doc_ids))

    @property
    def suffix_ids(self) -> torch.Tensor:
        """``[S]`` int64, the document tokens."""
        return torch.cat(self.doc_ids)

    @property
    def relevance_ids(self) -> torch.Tensor:
        """Query tokens for relevance scoring: ``question_ids`` when known, else ``query_ids``."""
        return self.question_ids if self.question_ids is not None else self.query_ids

    @property
    def text(self) -> str | None:
        """Pre-query text ``prefix_text + doc_texts`` (``None`` for token-level prompts)."""
        if self.prefix_text is None or self.doc_texts is None:
            return None
        return self.prefix_text + "".join(self.doc_texts)

    def check_doc(self, doc: int, name: str = "start") -> int:
        """Validate a document index.

        Raises:
            ValueError: naming ``name`` when ``doc`` is not in ``[0, n)``.
        """
        if int(doc) != doc or not 0 <= doc < self.num_docs:
            raise ValueError(f"{name}={doc!r} is out of range; documents are 0 .. {self.num_docs - 1}")
        return int(doc)


def compose_tokens(prefix_ids, documents: Sequence, query_ids, *, question_ids=None, supporting=None,
                   titles=None) -> ComposedPrompt:
    """Build a token-level composed prompt (tiny random models, synthetic studies).

    Args:
        prefix_ids: ``[p]`` shared prefix ids, p >= 1.
        documents: n >= 1 sequences of document ids, each non-empty.
        query_ids: ``[Q]`` non-empty.
        question_ids: optional relevance query (defaults to ``query_ids``).
        supporting: optional per-document gold-evidence flags.
        titles: optional per-document titles.

    Raises:
        TypeError: naming the argument when ids are not integers (float ids are not truncated).
        ValueError: see :class:`ComposedPrompt`; also naming ``prefix_ids``/``doc_ids[i]``/``query_ids`` for a batch
            of several sequences (``[2, N]`` is not flattened) or a negative id.
    """
    if documents is None or len(documents) == 0:
        raise ValueError("documents is empty; a composed prompt needs at least one document")
    return ComposedPrompt(
        prefix_ids=prefix_ids,
        doc_ids=tuple(documents),
        query_ids=query_ids,
        question_ids=question_ids,
        supporting=tuple(bool(s) for s in supporting) if supporting is not None else (),
        titles=tuple(titles) if titles is not None else (),
    )


def _passage_fields(p) -> tuple[str, str, bool]:
    if hasattr(p, "title"):
        return str(p.title), str(p.text), bool(getattr(p, "is_supporting", False))
    title, text = p[0], p[1]
    return str(title), str(text), bool(p[2]) if len(p) > 2 else False


def compose_prompt(tokenizer, passages: Sequence, question: str, *, instruction: str = DEFAULT_INSTRUCTION,
                   system: str | None = None, max_doc_tokens: int | None = None) -> ComposedPrompt:
    """Render a chat RAG prompt and split it into prefix, document and query segments.

    The user message is ``"{instruction}\\n\\n{doc_0}\\n\\n...{doc_{n-1}}\\n\\nQuestion: {question}"`` rendered with the
    model's chat template (:func:`sur_lab.edits.render_chat`), documents formatted ``"Title: {title}\\n{text}"``. The
    prefix segment ends just before the first document; document i's segment is its block plus the following blank
    line; the query segment starts at ``"Question:"``. Each segment is tokenized on its own.

    Args:
        tokenizer: the model's fast tokenizer with a chat template.
        passages: n >= 1 objects with ``title``, ``text`` (and optionally ``is_supporting``), or tuples.
        question: the question (also the relevance query).
        instruction: text before the documents in the user message.
        system: optional system message (the template's default otherwise).
        max_doc_tokens: optional per-block token cap (:func:`sur_lab.data.text.truncate_text`; the trailing blank line adds one token);
            ``None`` keeps passages whole.

    Returns:
        ComposedPrompt with text, offsets, containers, titles and supporting flags.

    Raises:
        ValueError: naming ``documents`` when ``passages`` is empty, ``question`` when empty, ``max_doc_tokens`` when
            below 8, or ``tokenizer`` when the template does not place the query right after the documents.
    """
    if passages is None or len(passages) == 0:
        raise ValueError("documents is empty; a composed prompt needs at least one document")
    if not question or not question.strip():
        raise ValueError("question must be non-empty (empty query)")
    fields = [_passage_fields(p) for p in passages]
    blocks = []
    for title, text, _ in fields:
        if max_doc_tokens is not None:
            text = truncate_text(tokenizer, title, text, max_doc_tokens)
        blocks.append(f"Title: {title}\n{text.strip()}")
    documents = DOC_SEPARATOR.join(blocks)
    pre, query_text, doc_start, containers = render_chat(
        tokenizer, documents, question, instruction=instruction, system=system
    )
    if not query_text.startswith(DOC_SEPARATOR):
        raise ValueError("tokenizer's chat template does not place the query right after the documents")
    segments = [pre[:doc_start]] + [b + DOC_SEPARATOR for b in blocks]
    query_text = query_text[len(DOC_SEPARATOR):]
    ids: list[list[int]] = []
    offsets: list[tuple[int, int]] = []
    pos = 0
    for seg in segments:
        enc = tokenizer(seg, add_special_tokens=False, return_offsets_mapping=True)
        ids.append(list(enc["input_ids"]))
        offsets.extend((pos + a, pos + b) for a, b in enc["offset_mapping"])
        pos += len(seg)
    # The last separator was moved from the query into the last document, so containers end one separator later.
    text_len = pos
    containers = tuple((a, min(b + len(DOC_SEPARATOR), text_len) if b == len(pre) else b, k) for a, b, k in containers)
    return ComposedPrompt(
        prefix_ids=torch.tensor(ids[0], dtype=torch.long),
        doc_ids=tuple(torch.tensor(d, dtype=torch.long) for d in ids[1:]),
        query_ids=torch.tensor(tokenizer(query_text, add_special_tokens=False)["input_ids"], dtype=torch.long),
        question=question.strip(),
        question_ids=torch.tensor(tokenizer(question.strip(), add_special_tokens=False)["input_ids"], dtype=torch.long),
        supporting=tuple(s for _, _, s in fields),
        titles=tuple(t for t, _, _ in fields),
        prefix_text=segments[0],
        doc_texts=tuple(segments[1:]),
        query_text=query_text,
        offsets=tuple(offsets),
        containers=containers,
    )


def composition_edit(prompt: ComposedPrompt) -> EditedContext:
    """Express a composed prompt as an :class:`EditedContext` so the deletion executors can repair it.

    The edit's prefix is the shared instruction prefix P (``prefix_len = p``) and its suffix is the composed documents
    (``suffix_len = S``): ``edit.edited_ids`` is ``P ⊕ D_0 ⊕ ... ⊕ D_{n-1}``, the exact prompt before the query, and
    ``edit.query_ids`` the query. ``EditedContext`` describes a deletion and requires ``deleted_len >= 1``, so the
    original sequence carries a one-token placeholder (:data:`PLACEHOLDER_TOKEN`) between P and the documents. No
    executor reads it: executors use ``edited_ids``, ``prefix_len`` and ``suffix_len`` and recompute a support
    against the cache they are given (here the composed cache of ``p + S`` rows, in place of a Shift cache). Do not
    call :func:`sur_lab.executors.dirty` / :func:`sur_lab.repair.prepare` on this edit: the placeholder is not text.

    Returns:
        EditedContext with text, offsets and containers when the prompt has them (SUR's semantic units use them).
    """
    original = torch.cat((prompt.prefix_ids, torch.tensor([PLACEHOLDER_TOKEN], dtype=torch.long), prompt.suffix_ids))
    return EditedContext(
        original_ids=original,
        query_ids=prompt.query_ids,
        prefix_len=prompt.prefix_len,
        deleted_len=1,
        question=prompt.question,
        question_ids=prompt.question_ids,
        edited_text=prompt.text,
        edited_offsets=prompt.offsets,
        containers=prompt.containers,
    )


# Prefix caches made by prefix_cache -> the token ids they encode, so that a cache of another prefix of the same
# length is refused (a length check alone lets it through and silently conditions every document on the wrong prefix).
_PREFIX_IDS: "weakref.WeakKeyDictionary[DynamicCache, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def prefix_cache(lm: LoadedModel, prompt: ComposedPrompt) -> DynamicCache:
    """Prefill the shared instruction prefix P (``p`` rows); shared by every document cache and every path."""
    cache = prefill(lm, prompt.prefix_ids)[0]
    _PREFIX_IDS[cache] = tuple(prompt.prefix_ids.tolist())
    return cache


def _check_prefix(prompt: ComposedPrompt, cache: DynamicCache) -> None:
    if cache_length(cache) != prompt.prefix_len:
        raise ValueError(f"prefix_kv has {cache_length(cache)} rows; the prompt's prefix has {prompt.prefix_len}")
    ids = _PREFIX_IDS.get(cache)
    if ids is not None and ids != tuple(prompt.prefix_ids.tolist()):
        raise ValueError("prefix_kv was prefilled from other prefix ids than the prompt's prefix_ids (same length p="
                         f"{prompt.prefix_len}); prefill the prompt's prefix with prefix_cache")


def doc_store_key(lm: LoadedModel, prompt: ComposedPrompt, doc: int) -> tuple:
    """The key of document ``doc``'s cache in a document store: everything the cache depends on.

    A prefix-conditioned document cache depends on the model (name, weights hash, dtype, device), the prefix ids it was
    encoded after (its keys carry positions ``p ..``) and the document's own ids, so the key holds all three: the same
    document after another prefix, or under another model, is encoded again, never reused.
    """
    fp = model_fingerprint(lm)
    return (tuple(fp.values()), tuple(prompt.prefix_ids.tolist()), tuple(prompt.doc_ids[doc].tolist()))


def document_caches(lm: LoadedModel, prompt: ComposedPrompt, prefix_kv: DynamicCache) -> list[DynamicCache]:
    """Prefix-conditioned document caches: each document encoded after P alone (SAFE-KV Fig. 1b).

    Args:
        lm: the model.
        prompt: the composed prompt.
        prefix_kv: cache of P (``p`` rows), e.g. from :func:`prefix_cache`; not modified.

    Returns:
        n caches; cache i holds ``L_i`` rows ``[1, H_kv, L_i, d_h]`` whose keys carry RoPE positions
        ``p .. p + L_i - 1`` (not yet re-positioned).

    Raises:
        ValueError: naming ``prefix_kv`` when it does not hold the prompt's ``p`` rows.
    """
    _check_prefix(prompt, prefix_kv)
    p = prompt.prefix_len
    out = []
    for ids in prompt.doc_ids:
        work = clone_cache(prefix_kv)
        forward_tokens(lm, ids, work, logits="none")
        out.append(slice_rows(work, p, p + int(ids.numel())))
    return out


def compose_cache(lm: LoadedModel, prompt: ComposedPrompt, prefix_kv: DynamicCache,
                  doc_kv: Sequence[DynamicCache]) -> DynamicCache:
    """Prefix-conditioned composition: P's rows, then each document's rows with keys re-rotated to its place.

    Document i was encoded at positions ``p + t``; in the prompt it sits at ``p + start_i + t``, so its keys are
    re-rotated by ``delta_i = start_i`` (:func:`sur_lab.cache_ops.rerotate_keys`, float64 angles); values are copied.
    The first document (``delta = 0``) is copied bitwise.

    Args:
        lm: the model (RoPE inverse frequencies).
        prompt: the composed prompt.
        prefix_kv: cache of P (``p`` rows); not modified.
        doc_kv: the n document caches of :func:`document_caches`; not modified.

    Returns:
        A new cache of ``p + S`` rows ``[1, H_kv, p + S, d_h]`` per layer.

    Raises:
        ValueError: naming ``doc_kv`` when it does not hold n caches of lengths ``L_i``, or ``prefix_kv``.
    """
    _check_prefix(prompt, prefix_kv)
    if len(doc_kv) != prompt.num_docs:
        raise ValueError(f"doc_kv has {len(doc_kv)} caches; the prompt has {prompt.num_docs} documents")
    for i, (c, n) in enumerate(zip(doc_kv, prompt.doc_lens)):
        if cache_length(c) != n:
            raise ValueError(f"doc_kv[{i}] has {cache_length(c)} rows; document {i} has {n} tokens")
    inv_freq = lm.inv_freq
    per_doc = [to_tensors(c) for c in doc_kv]
    layers = []
    for layer, (pk, pv) in enumerate(to_tensors(prefix_kv)):
        keys, values = [pk], [pv]
        for delta, doc in zip(prompt.doc_starts, per_doc):
            k, v = doc[layer]
            keys.append(k if delta == 0 else rerotate_keys(k, int(delta), inv_freq))
            values.append(v)
        # torch.cat copies, so the composed cache never aliases the stored document caches.
        layers.append((torch.cat(keys, dim=2), torch.cat(values, dim=2)))
    return from_tensors(layers)


def full_prefill_cache(lm: LoadedModel, prompt: ComposedPrompt, prefix_kv: DynamicCache) -> DynamicCache:
    """Full prefill of the exact prompt's documents after the shared prefix (SAFE-KV Fig. 1a; the reference).

    Returns:
        A new cache of ``p + S`` rows; ``prefix_kv`` is not modified.
    """
    _check_prefix(prompt, prefix_kv)
    work = clone_cache(prefix_kv)
    forward_tokens(lm, prompt.suffix_ids, work, logits="none")
    return work


@dataclass(frozen=True)
class CompositionCaches:
    """Every cache one composed prompt needs, with the timings of the online steps.

    Attributes:
        prefix: cache of P (``p`` rows), shared.
        documents: the n prefix-conditioned document caches (offline: computed once, reused across requests).
        composed: prefix-conditioned composition (``p + S`` rows).
        full: full prefill of the documents after P (``p + S`` rows), the reference.
        timings_ms: ``documents`` (offline encoding, ms), ``compose`` (re-rotation and concatenation, ms; online),
            ``full`` (forward of the S document tokens after P, ms; online for the full-prefill path).
    """

    prefix: DynamicCache
    documents: tuple[DynamicCache, ...]
    composed: DynamicCache
    full: DynamicCache
    timings_ms: dict[str, float] = field(default_factory=dict)


def build_caches(
    lm: LoadedModel, prompt: ComposedPrompt, prefix_kv: DynamicCache | None = None, doc_store: dict | None = None
) -> CompositionCaches:
    """Build the prefix, document, composed and full-prefill caches of ``prompt``, timing each online step.

    Args:
        lm: the model.
        prompt: the composed prompt.
        prefix_kv: a cache of P to share across prompts with the same prefix (prefilled here when ``None``);
            not modified.
        doc_store: optional ``{doc_store_key(...): DynamicCache}`` reused across prompts and filled with the
            documents encoded here (offline caches are computed once per document and prefix, as in RAG serving).
            Keys hold the model fingerprint, the prefix ids and the document ids (:func:`doc_store_key`), so a store
            shared across prefixes or models never returns a cache encoded for another one.

    Raises:
        ValueError: naming ``prefix_kv`` when its length is not p, or when it was made by :func:`prefix_cache` from
            other prefix ids.
    """
    prefix_kv = prefix_kv if prefix_kv is not None else prefix_cache(lm, prompt)
    t0 = time.perf_counter()
    if doc_store is None:
        docs = document_caches(lm, prompt, prefix_kv)
    else:
        keys = [doc_store_key(lm, prompt, i) for i in range(prompt.num_docs)]
        missing = [i for i, k in enumerate(keys) if k not in doc_store]
        if missing:
            sub = ComposedPrompt(prompt.prefix_ids, tuple(prompt.doc_ids[i] for i in missing), prompt.query_ids)
            for i, c in zip(missing, document_caches(lm, sub, prefix_kv)):
                doc_store[keys[i]] = c
        docs = [doc_store[k] for k in keys]
    t1 = time.perf_counter()
    composed = compose_cache(lm, prompt, prefix_kv, docs)
    t2 = time.perf_counter()
    full = full_prefill_cache(lm, prompt, prefix_kv)
    t3 = time.perf_counter()
    timings = {"documents": (t1 - t0) * 1e3, "compose": (t2 - t1) * 1e3, "full": (t3 - t2) * 1e3}
    return CompositionCaches(prefix_kv, tuple(docs), composed, full, timings)

__all__ = [
    "ComposedPrompt",
    "CompositionCaches",
    "DOC_SEPARATOR",
    "PLACEHOLDER_TOKEN",
    "build_caches",
    "compose_cache",
    "compose_prompt",
    "compose_tokens",
    "composition_edit",
    "doc_store_key",
    "document_caches",
    "full_prefill_cache",
    "prefix_cache",
]
