"""Edits built from token segments (issue 13): the same edit semantics on SmolLM2's, Qwen2.5's and a byte-level BPE
tokenizer built here, including boundaries that the whole-text tokenization merges (``".\\n\\n"``), unicode, an
empty suffix, and character boundaries inside a token."""

from __future__ import annotations

from pathlib import Path

import pytest

from sur_lab.edits import (
    build_edit,
    chat_edit,
    chat_prompt_ids,
    format_passages,
    segment_edit,
    tokenize_segments,
)

QWEN_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers" / "qwen2.5-coder-0.5b-instruct"
if not QWEN_DIR.is_dir():
    QWEN_DIR = Path("/work/shared/data/tokenizers/qwen2.5-coder-0.5b-instruct")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PASSAGES = [
    ("Alpha", "Alpha is a letter. It comes first."),
    ("Café Zürich", "A café in Zürich serves crème brûlée; 日本語 text and an emoji 🙂 follow."),
    ("Gamma", "Gamma is third. It ends with a full stop."),
]
QUESTION = "Which letter is first?"


def _byte_level_tokenizer():
    """A byte-level BPE trained here without a pre-tokenizer split, so merges cross ``".\\n\\n"`` and word edges."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    model = tokenizers.models.BPE()
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [f"{t}\n{x}.\n\nQuestion: {QUESTION}" for t, x in PASSAGES] * 20 + ["first.\n\nTitle: ", "café Zürich"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5", "byte-level"])
def tokenizer(request):
    if request.param == "byte-level":
        return _byte_level_tokenizer()
    from transformers import AutoTokenizer

    if request.param == "qwen2.5":
        if not (QWEN_DIR / "tokenizer.json").is_file():
            pytest.skip(f"Qwen2.5 tokenizer files not found at {QWEN_DIR}")
        return AutoTokenizer.from_pretrained(QWEN_DIR)
    from sur_lab.models import embedded_tokenizer

    try:
        return embedded_tokenizer()
    except FileNotFoundError as err:
        pytest.skip(f"SmolLM2 tokenizer unavailable (embedded GGUF package not installed): {err}")


def _decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_passage_deletion_gives_the_clean_prompt_segments(tokenizer, victim):
    documents, spans = format_passages(PASSAGES)
    edit = chat_edit(tokenizer, documents, QUESTION, spans[victim])
    clean_docs, _ = format_passages([p for i, p in enumerate(PASSAGES) if i != victim])
    clean = chat_prompt_ids(tokenizer, clean_docs, QUESTION)
    # Re-prefill prefills edit.edited_ids: exactly the clean prompt's segment tokens, then the query.
    assert edit.edited_ids.tolist() + edit.query_ids.tolist() == clean.tolist()
    deleted = edit.original_ids[edit.prefix_len : edit.prefix_len + edit.deleted_len]
    assert _decode(tokenizer, deleted) == documents[slice(*spans[victim])]
    assert _decode(tokenizer, edit.original_ids) == edit.original_text
    assert _decode(tokenizer, edit.edited_ids) == edit.edited_text
    assert _decode(tokenizer, edit.query_ids).startswith("\n\nQuestion: " + QUESTION)
    assert len(edit.original_offsets) == edit.num_tokens and len(edit.edited_offsets) == edit.edited_len
    assert edit.question_ids.tolist() == tokenizer(QUESTION, add_special_tokens=False)["input_ids"]


def test_deleting_the_last_passage_leaves_an_empty_suffix(tokenizer):
    documents, spans = format_passages(PASSAGES)
    edit = chat_edit(tokenizer, documents, QUESTION, spans[-1])
    assert edit.suffix_len == 0
    assert edit.edited_ids.tolist() == edit.original_ids[: edit.prefix_len].tolist()
    assert edit.edited_text.endswith(documents[: spans[-1][0]])


def test_query_boundary_that_the_whole_text_merges(tokenizer):
    """The documents end with ``"."`` and the query starts with ``"\\n\\n"``: where the whole-text tokenization has a
    token across that boundary, the segment edit still cuts there and the query is tokenized on its own."""
    documents, spans = format_passages(PASSAGES)
    edit = chat_edit(tokenizer, documents, QUESTION, spans[0])
    text = edit.original_text
    query = _decode(tokenizer, edit.query_ids)
    whole = tokenizer(text + query, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    crosses = any(a < len(text) < b for a, b in whole)
    if tokenizer.name_or_path and "qwen" in str(tokenizer.name_or_path).lower():
        assert crosses, "Qwen2.5 merges '.\\n\\n' across the documents/query boundary"
    assert edit.query_ids.tolist() == tokenizer(query, add_special_tokens=False)["input_ids"]
    assert edit.original_offsets[-1][1] == len(text)


def test_byte_level_merge_across_the_query_boundary_is_real():
    tok = _byte_level_tokenizer()
    documents, spans = format_passages(PASSAGES)
    edit = chat_edit(tok, documents, QUESTION, spans[0])
    text, query = edit.original_text, _decode(tok, edit.query_ids)
    whole = tok(text + query, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert any(a < len(text) < b for a, b in whole)  # the hazard exists for this tokenizer
    assert edit.edited_ids.tolist() + edit.query_ids.tolist() == chat_prompt_ids(
        tok, format_passages(PASSAGES[1:])[0], QUESTION).tolist()


@pytest.mark.parametrize("cut", ["mid-word", "mid-unicode-word"])
def test_character_span_inside_a_token_is_kept_exactly(tokenizer, cut):
    documents, _ = format_passages(PASSAGES)
    word = "letter" if cut == "mid-word" else "brûlée"
    start = documents.index(word) + 2
    end = start + 3
    edit = chat_edit(tokenizer, documents, QUESTION, (start, end))
    deleted = edit.original_ids[edit.prefix_len : edit.prefix_len + edit.deleted_len]
    assert _decode(tokenizer, deleted) == documents[start:end]
    assert _decode(tokenizer, edit.edited_ids) == edit.edited_text
    assert documents[:start] + documents[end:] in edit.edited_text


def test_segment_edit_concatenates_segment_tokenizations(tokenizer):
    prefix, deleted, suffix, query = ["Intro: café.", "\n\n"], "Deleted 🙂 span.\n\n", ["Kept.", ""], "\n\nQuestion: x?"
    edit = segment_edit(tokenizer, prefix, deleted, suffix, query, question="x?")
    ids, _ = tokenize_segments(tokenizer, [*prefix, deleted, *suffix])
    assert edit.original_ids.tolist() == [t for seg in ids for t in seg]
    assert edit.prefix_len == len(ids[0]) + len(ids[1]) and edit.deleted_len == len(ids[2])
    assert edit.query_ids.tolist() == tokenizer(query, add_special_tokens=False)["input_ids"]
    assert edit.deleted_char_span == (len("".join(prefix)), len("".join(prefix)) + len(deleted))


def test_build_edit_cuts_at_the_span_and_the_given_cuts(tokenizer):
    text = "Head.\n\nFirst part.\n\nSecond part."
    edit = build_edit(tokenizer, text, "\n\nQ: ?", (7, 20), cuts=(7, 20))
    ids, _ = tokenize_segments(tokenizer, ["Head.\n\n", "First part.\n\n", "Second part."])
    assert edit.original_ids.tolist() == [t for seg in ids for t in seg]
    assert (edit.prefix_len, edit.deleted_len) == (len(ids[0]), len(ids[1]))


def test_bad_inputs_are_refused_with_the_argument_named():
    tok = _byte_level_tokenizer()
    documents, spans = format_passages(PASSAGES)
    with pytest.raises(ValueError, match="documents must be a str"):
        chat_edit(tok, [documents], QUESTION, spans[0])
    with pytest.raises(ValueError, match="span=.*pair"):
        chat_edit(tok, documents, QUESTION, (0, 5, 9))
    with pytest.raises(ValueError, match="span=.*integer"):
        chat_edit(tok, documents, QUESTION, (0.0, 5.5))
    with pytest.raises(ValueError, match="span=.*empty"):
        chat_edit(tok, documents, QUESTION, (5, 5))
    with pytest.raises(ValueError, match="span=.*out of range"):
        chat_edit(tok, documents, QUESTION, (0, len(documents) + 1))
    with pytest.raises(ValueError, match="cuts"):
        build_edit(tok, "abc def", "\n\nQ?", (0, 3), cuts=(99,))
    with pytest.raises(ValueError, match="deleted"):
        segment_edit(tok, "abc", "", "def", "\n\nQ?")
    # Issue 38: no tokenizer, or an object that is not one, is named (not an AttributeError from inside the template)
    for bad in (None, "Qwen/Qwen2.5-0.5B", object()):
        with pytest.raises(TypeError, match=f"tokenizer must be a transformers tokenizer with a chat template.*got "
                                            f"{type(bad).__name__}"):
            chat_edit(bad, documents, QUESTION, spans[0])
    # numpy integers are integers, not truncated floats
    np = pytest.importorskip("numpy")
    edit = chat_edit(tok, documents, QUESTION, (np.int64(spans[1][0]), np.int64(spans[1][1])))
    assert edit.deleted_char_span[1] - edit.deleted_char_span[0] == spans[1][1] - spans[1][0]


def test_tokenizer_that_adds_a_prefix_space_is_refused():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(["abc def"] * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    with pytest.raises(ValueError, match="tokenizer does not reproduce"):
        tokenize_segments(fast, ["abc", "def"])


@pytest.fixture(scope="module")
def qwen_tokenizer():
    if not (QWEN_DIR / "tokenizer.json").is_file():
        pytest.skip(f"Qwen2.5 tokenizer files not found at {QWEN_DIR}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN_DIR)


def test_study_builders_work_with_the_qwen_tokenizer(qwen_tokenizer, data_dir):
    """Quickstart, natural QA and NIAH cases build on Qwen's tokenizer, which merges '.\\n\\n' (issue 13)."""
    from sur_lab.data.qa import load_qa
    from sur_lab.data.text import PanelConfig
    from sur_lab.studies.natural_qa import build_cases, select_panel
    from sur_lab.studies.niah import NEEDLE_TEMPLATE, build_niah_cases
    from sur_lab.studies.quickstart import quickstart_edit

    tok = qwen_tokenizer
    example = next(e for e in load_qa("hotpotqa") if e.distractors and e.supporting)
    edit = quickstart_edit(tok, example)
    assert _decode(tok, edit.original_ids[edit.prefix_len : edit.prefix_len + edit.deleted_len]).startswith("Title: ")
    cases = build_cases(tok, select_panel(("hotpotqa",), 2, PanelConfig()))  # checks the clean prompt token for token
    assert len(cases) == 6
    (case,) = build_niah_cases(tok, context_lens=(512,), depths=(0.3, 0.7), num_cases=1, seed=0)
    for (ts, te), value in zip(case.needle_token_spans, case.values):
        needle = NEEDLE_TEMPLATE.format(key=case.key, value=value)
        assert _decode(tok, case.edit.original_ids[ts:te]) in (needle, needle + "\n\n")
