"""Contexts and edits: prefix p, deleted span e, retained suffix s and query q (section 3.1).

A context is the token sequence of a chat-rendered prompt up to the query. An edit deletes tokens ``[p, p + d)``: the
original pre-query sequence is ``x = p ⊕ e ⊕ s`` (N = p + d + S tokens) and the edited one is ``x⁻ = p ⊕ s``. The query
``q`` is processed after whichever cache a repair produced. Edits are built from text by character spans mapped to
token spans through the tokenizer's offsets; the builder verifies that the edited token sequence equals the
tokenization of the edited text, and refuses spans that split a token or reach into the query.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from sur_lab.checks import as_count, as_token_ids

#: Instruction placed before the documents in :func:`chat_edit` prompts.
DEFAULT_INSTRUCTION = "Answer the question using the documents below. Reply with a short answer only."


@dataclass(frozen=True)
class EditedContext:
    """One deletion edit of a cached context, with the query that follows it.

    Attributes:
        original_ids: ``[N]`` int64, the Dirty pre-query tokens ``p ⊕ e ⊕ s``.
        query_ids: ``[Q]`` int64, tokens processed after the repaired cache (question plus chat-template tail).
        prefix_len: p, tokens before the deleted span (an integer; floats are refused, not truncated).
        deleted_len: d >= 1, deleted tokens. A whole-context deletion (p = 0, d = N) is refused at construction with
            a ``ValueError`` naming ``deleted_len``: nothing would remain to cache, so no method (Shift, Replay,
            Re-prefill, SUR) has a cache to return; every edit keeps p + S >= 1 tokens.
        question: the query text used for relevance scoring (SUR, Eq. 7), or ``None`` for token-level edits.
        question_ids: ``[|q|]`` int64, ``question`` tokenized without special tokens (Eq. 7, appendix 7.3).
        original_text / edited_text: pre-query text before and after the deletion (``None`` for token-level edits).
        edited_offsets: ``(start, end)`` character span in ``edited_text`` of each edited token (``N - d`` entries).
        containers: ``(start, end, kind)`` character spans in ``edited_text`` of message and structured containers;
            semantic units never cross their boundaries (appendix 7.3).
        deleted_char_span: ``(start, end)`` of the deleted text in ``original_text``.
    """

    original_ids: torch.Tensor
    query_ids: torch.Tensor
    prefix_len: int
    deleted_len: int
    question: str | None = None
    question_ids: torch.Tensor | None = None
    original_text: str | None = None
    edited_text: str | None = None
    edited_offsets: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    containers: tuple[tuple[int, int, str], ...] = ()
    deleted_char_span: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "original_ids", as_token_ids(self.original_ids, "original_ids", allow_empty=True))
        object.__setattr__(self, "query_ids", as_token_ids(self.query_ids, "query_ids", allow_empty=True))
        if self.query_ids.numel() == 0:
            raise ValueError("query_ids must be a non-empty 1-D tensor (empty query)")
        object.__setattr__(self, "prefix_len", as_count(self.prefix_len, "prefix_len"))
        object.__setattr__(self, "deleted_len", as_count(self.deleted_len, "deleted_len"))
        n = int(self.original_ids.numel())
        if self.deleted_len < 1:
            raise ValueError(f"deleted_len must be >= 1 (empty span); got {self.deleted_len}")
        if self.prefix_len + self.deleted_len > n:
            raise ValueError(
                f"span [prefix_len={self.prefix_len}, {self.prefix_len + self.deleted_len}) must lie in [0, {n}]"
            )
        if self.deleted_len == n:
            # Whole-context deletion (p = 0, d = N): nothing is left to cache, so no method has a cache to repair.
            # Refused here, at edit time, so that every method behaves alike.
            raise ValueError(
                f"deleted_len={self.deleted_len} with prefix_len=0 deletes the whole context of {n} tokens; "
                "an edit must keep at least one token (p + S >= 1): start a new prompt instead"
            )
        if self.question_ids is not None:
            object.__setattr__(self, "question_ids", as_token_ids(self.question_ids, "question_ids", allow_empty=True))
            if self.question_ids.numel() == 0:
                raise ValueError("question must contain at least one token (empty query)")

    @property
    def num_tokens(self) -> int:
        """N, tokens of the original pre-query sequence."""
        return int(self.original_ids.numel())

    @property
    def suffix_len(self) -> int:
        """S, retained suffix tokens."""
        return self.num_tokens - self.prefix_len - self.deleted_len

    @property
    def edited_len(self) -> int:
        """p + S, tokens of the edited pre-query sequence."""
        return self.num_tokens - self.deleted_len

    @property
    def edited_ids(self) -> torch.Tensor:
        """``[p + S]`` int64, the edited pre-query tokens ``p ⊕ s``."""
        return torch.cat((self.original_ids[: self.prefix_len], self.original_ids[self.prefix_len + self.deleted_len :]))

    @property
    def suffix_ids(self) -> torch.Tensor:
        """``[S]`` int64, the retained suffix tokens."""
        return self.original_ids[self.prefix_len + self.deleted_len :]

    @property
    def relevance_ids(self) -> torch.Tensor:
        """Query tokens for relevance scoring: ``question_ids`` when known, else ``query_ids``."""
        return self.question_ids if self.question_ids is not None else self.query_ids

    @property
    def suffix_slice(self) -> slice:
        """Absolute positions of the suffix in the edited context: ``slice(p, p + S)``."""
        return slice(self.prefix_len, self.edited_len)


def token_edit(
    original_ids,
    prefix_len: int,
    deleted_len: int,
    query_ids,
    *,
    question_ids=None,
) -> EditedContext:
    """Build a token-level edit (no text; for tiny random models and synthetic studies).

    Args:
        original_ids: ``[N]`` integer token ids ``p ⊕ e ⊕ s`` (a ``[1, N]`` tensor is batch size one).
        prefix_len: p >= 0, an integer.
        deleted_len: d >= 1, an integer; ``p + d <= N`` and the edit keeps at least one token (``p + S >= 1``).
        query_ids: ``[Q]`` non-empty integer ids.
        question_ids: optional relevance query ``[|q|]`` (defaults to ``query_ids``).

    Raises:
        TypeError: naming ``original_ids``/``query_ids``/``question_ids`` when the ids are not integers (floats are
            not truncated), or ``prefix_len``/``deleted_len`` when they are not integers (``3.7``, ``True``).
        ValueError: naming ``original_ids``/``query_ids`` for a batch of several sequences (``[2, N]`` is not
            flattened) or a negative id; ``deleted_len`` (empty span, or the whole context: p = 0, d = N);
            ``prefix_len`` (out of range); ``query_ids`` (empty).
    """
    return EditedContext(
        original_ids=original_ids,
        query_ids=query_ids,
        prefix_len=prefix_len,
        deleted_len=deleted_len,
        question_ids=question_ids,
    )


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _token_index(starts: list[int], char: int, what: str, text_len: int) -> int:
    """Index of the token starting at ``char``; ValueError naming ``span`` if ``char`` falls inside a token."""
    i = bisect.bisect_left(starts, char)
    if i < len(starts) and starts[i] == char:
        return i
    if char == text_len:
        return len(starts)
    before = starts[i - 1] if i > 0 else 0
    after = starts[i] if i < len(starts) else text_len
    raise ValueError(
        f"span {what} at character {char} splits a token; nearest token boundaries are {before} and {after}"
    )


def build_edit(
    tokenizer,
    text: str,
    query_text: str,
    span: tuple[int, int],
    *,
    question: str | None = None,
    containers: tuple[tuple[int, int, str], ...] = (),
) -> EditedContext:
    """Build an edit that deletes characters ``span = (start, end)`` of the pre-query ``text``.

    Args:
        tokenizer: a fast tokenizer (offsets required).
        text: the rendered prompt up to the query (may contain chat-template special tokens as text).
        query_text: the rendered text after ``text`` (question and template tail); non-empty.
        span: half-open character span in ``text`` to delete; must start and end on token boundaries.
        question: relevance query for SUR (defaults to ``query_text``), tokenized without special tokens.
        containers: ``(start, end, kind)`` character spans in ``text`` of messages / structured containers.

    Returns:
        EditedContext with token spans, edited text, offsets and containers mapped to the edited text.

    Raises:
        ValueError: naming ``span`` when it is empty, out of range, reaches into the query, splits a token, or when
            deleting it changes the tokenization of the retained text; naming ``query_text``/``question`` when empty;
            naming ``text`` when the text/query boundary splits a token.
    """
    if not query_text or (question is not None and not question.strip()):
        raise ValueError("query_text and question must be non-empty (empty query)")
    start, end = (int(span[0]), int(span[1]))
    total = len(text) + len(query_text)
    if start >= end:
        raise ValueError(f"span=({start}, {end}) is empty; need start < end")
    if start < 0 or end > total:
        raise ValueError(f"span=({start}, {end}) is out of range; need 0 <= start < end <= {len(text)}")
    if end > len(text):
        raise ValueError(f"span=({start}, {end}) reaches into the query, which starts at character {len(text)}")

    ids, offsets = _encode(tokenizer, text + query_text)
    starts = [o[0] for o in offsets]
    q0 = _token_index(starts, len(text), "text/query boundary", total)
    if q0 == 0 or offsets[q0 - 1][1] > len(text):
        raise ValueError(f"text ends inside a token at character {len(text)}; move the query boundary")
    a = _token_index(starts, start, "start", total)
    b = _token_index(starts, end, "end", total)
    if b > q0:
        raise ValueError(f"span=({start}, {end}) reaches into the query tokens")

    edited_text = text[:start] + text[end:]
    edited_ids, edited_offsets = _encode(tokenizer, edited_text + query_text)
    expected = ids[:a] + ids[b:]
    if edited_ids != expected:
        first = next((i for i, (x, y) in enumerate(zip(edited_ids, expected)) if x != y), min(len(edited_ids), len(expected)))
        raise ValueError(
            f"deleting span=({start}, {end}) changes the tokenization of the retained text near edited token {first} "
            "(a merge across the cut); choose a span whose ends sit at word or line boundaries"
        )
    n_pre = q0 - (b - a)
    width = end - start

    def to_edited(c: int) -> int:
        return c if c <= start else max(start, c - width)

    mapped = tuple(
        (to_edited(cs), to_edited(ce), kind) for cs, ce, kind in containers if to_edited(ce) > to_edited(cs)
    )
    q_text = question if question is not None else query_text
    question_ids = tokenizer(q_text, add_special_tokens=False)["input_ids"]
    return EditedContext(
        original_ids=torch.tensor(ids[:q0], dtype=torch.long),
        query_ids=torch.tensor(ids[q0:], dtype=torch.long),
        prefix_len=a,
        deleted_len=b - a,
        question=q_text,
        question_ids=torch.tensor(question_ids, dtype=torch.long),
        original_text=text,
        edited_text=edited_text,
        edited_offsets=tuple(edited_offsets[:n_pre]),
        containers=mapped,
        deleted_char_span=(start, end),
    )


def render_chat(tokenizer, documents: str, question: str, *, instruction: str = DEFAULT_INSTRUCTION, system=None):
    """Render the chat prompt used throughout sur_lab and locate its parts.

    The user message is ``"{instruction}\\n\\n{documents}\\n\\nQuestion: {question}"``; the query (what follows the
    cached context) is ``"\\n\\nQuestion: {question}"`` plus the template's end of turn and generation prompt. The
    model's native chat template is used with ``add_generation_prompt=True`` (no reasoning mode).

    Returns:
        ``(pre_query_text, query_text, documents_start, containers)`` where ``documents_start`` is the character offset
        of ``documents`` in ``pre_query_text`` and ``containers`` are the message-content spans in it.

    Raises:
        ValueError: if ``documents`` or ``question`` is empty or the template drops the documents.
    """
    if not documents.strip():
        raise ValueError("documents must be non-empty")
    if not question.strip():
        raise ValueError("question must be non-empty (empty query)")
    user = f"{instruction}\n\n{documents}" if instruction else documents
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"{user}\n\nQuestion: {question}"}
    ]
    # enable_thinking=False keeps reasoning templates (Qwen3) out of thinking mode; other templates ignore it.
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    user_start = rendered.rfind(user)
    if user_start < 0:
        raise ValueError("the chat template altered the documents; cannot locate them in the rendered prompt")
    doc_start = user_start + (len(user) - len(documents))
    cut = user_start + len(user)
    containers: list[tuple[int, int, str]] = []
    if system and (s := rendered.find(system)) >= 0:
        containers.append((s, s + len(system), "message"))
    elif not system:
        # Templates that insert a default system message (SmolLM2 does) still get it as its own container.
        head = rendered[:user_start]
        if "system" in head:
            containers.append((0, user_start, "message"))
    containers.append((user_start, cut, "message"))
    return rendered[:cut], rendered[cut:], doc_start, tuple(containers)


def chat_edit(
    tokenizer,
    documents: str,
    question: str,
    span: tuple[int, int],
    *,
    instruction: str = DEFAULT_INSTRUCTION,
    system: str | None = None,
) -> EditedContext:
    """Build an edit of a chat prompt that deletes ``documents[span[0]:span[1]]``.

    Args:
        tokenizer: the model's fast tokenizer with a chat template.
        documents: context text (e.g. passages joined by blank lines).
        question: the next query; also the relevance query for SUR.
        span: half-open character span *relative to* ``documents``.
        instruction: text before the documents in the user message.
        system: optional system message (the template's default is used otherwise).

    Raises:
        ValueError: as :func:`build_edit` and :func:`render_chat`, with ``span`` reported relative to ``documents``.
    """
    start, end = span
    if not 0 <= start < end <= len(documents):
        if start >= end:
            raise ValueError(f"span=({start}, {end}) is empty; need start < end")
        raise ValueError(
            f"span=({start}, {end}) is out of range; need 0 <= start < end <= len(documents) = {len(documents)} "
            "(the query follows the documents and cannot be deleted)"
        )
    text, query_text, doc_start, containers = render_chat(
        tokenizer, documents, question, instruction=instruction, system=system
    )
    return build_edit(
        tokenizer,
        text,
        query_text,
        (doc_start + start, doc_start + end),
        question=question,
        containers=containers,
    )


def format_passages(passages) -> tuple[str, list[tuple[int, int]]]:
    """Join passages as ``"Title: {title}\\n{text}"`` blocks separated by blank lines.

    Args:
        passages: objects with ``title`` and ``text`` attributes, or ``(title, text)`` pairs.

    Returns:
        ``(documents, spans)`` where ``spans[i]`` is the character span of passage i *including* its trailing blank
        line separator (the last passage's span ends at the end of the text), so deleting ``spans[i]`` leaves exactly
        the documents formatted without passage i.
    """
    blocks = []
    for p in passages:
        title, text = (p.title, p.text) if hasattr(p, "title") else p
        blocks.append(f"Title: {title}\n{text.strip()}")
    spans, pos = [], 0
    for i, block in enumerate(blocks):
        sep = 2 if i < len(blocks) - 1 else 0
        spans.append((pos, pos + len(block) + sep))
        pos += len(block) + sep
    documents = "\n\n".join(blocks)
    if len(blocks) > 1:
        # The last passage owns the separator before it, so its deletion also removes that blank line.
        last0 = spans[-1][0]
        spans[-1] = (last0 - 2, len(documents))
    return documents, spans
