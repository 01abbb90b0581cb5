"""Erasing-NIAH construction (spans, gold lists, the edited context) and the appendix 7.5 answer parser."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_allocators import char_tokenizer

from sur_lab.edits import passage_cuts, render_chat, tokenize_segments
from sur_lab.data.qa import Passage
from sur_lab.data.text import join_blocks
from sur_lab.studies.niah import (
    ANSWER_PREFIX_TEMPLATE,
    NEEDLE_TEMPLATE,
    NIAH_INSTRUCTION,
    QUESTION_TEMPLATE,
    build_niah_case,
    build_niah_cases,
    niah_exact_match,
    niah_scorer,
    parse_niah_answer,
)

CORPUS = [
    Passage(f"Topic {chr(65 + i % 26)}{i}", f"This paragraph describes subject {i}. It has a second sentence.", False)
    for i in range(60)
]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


# ---------------------------------------------------------------------------------------------------------------------
# Parser


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1234567, 7654321", ("1234567", "7654321")),
        ("The numbers are:\n1234567\n\n7654321.", ("1234567", "7654321")),  # newlines do not truncate
        ("1234567, 1234567", ("1234567", "1234567")),  # no de-duplication
        ("<think>maybe 111</think>Answer: 222", ("222",)),  # thinking block removed
        ("draft 999</think> 333", ("333",)),  # text after the response boundary only
        ("<think>still thinking 444", ()),  # never left the thinking block
        ("analysis 5<|channel|>final<|message|>66, 77", ("66", "77")),
        ("88<|im_end|>99", ("88",)),  # end of turn cuts
        ("1. 4821937\n2. 7310462", ("1", "4821937", "2", "7310462")),  # enumerators are digits too
        ("", ()),
        ("no numbers here", ()),
    ],
)
def test_parse_niah_answer(text, expected):
    assert parse_niah_answer(text) == expected


def test_exact_match_requires_order_and_multiplicity():
    assert niah_exact_match(("1", "2"), ("1", "2"))
    assert not niah_exact_match(("2", "1"), ("1", "2"))
    assert not niah_exact_match(("1", "1"), ("1",))
    assert not niah_exact_match(("1",), ("1", "2"))


# ---------------------------------------------------------------------------------------------------------------------
# Builder


@given(st.lists(st.text(alphabet="ab c\n.", min_size=1, max_size=8).filter(lambda s: "\n\n" not in s), min_size=1,
                max_size=6), st.data())
def test_join_blocks_deleting_a_span_leaves_the_others_joined(blocks, data):
    documents, spans = join_blocks(blocks)
    i = data.draw(st.integers(0, len(blocks) - 1))
    a, b = spans[i]
    assert documents[:a] + documents[b:] == join_blocks(blocks[:i] + blocks[i + 1 :])[0]


@pytest.mark.parametrize(
    "depths,delete", [((0.2, 0.7), 0), ((0.2, 0.7), 1), ((0.9, 0.1), 0), ((0.5, 0.5), 1), ((0.0, 1.0), 1)]
)
def test_builder_records_spans_and_gold_and_the_edited_context(tok, depths, delete):
    case = build_niah_case(tok, CORPUS, context_len=700, depths=depths, delete=delete, seed=3)
    edit = case.edit
    key = case.key
    # Gold lists: both values in order of appearance; the edit keeps the other one.
    assert case.gold_original == case.values and len(set(case.values)) == 2
    assert all(v.isdigit() and len(v) == 7 for v in case.values)
    assert case.gold == (case.values[1 - case.deleted],)
    assert case.depths == tuple(sorted(case.depths))
    # Needle spans in characters and tokens.
    for (cs, ce), (ts, te), value in zip(case.needle_char_spans, case.needle_token_spans, case.values):
        needle = NEEDLE_TEMPLATE.format(key=key, value=value)
        assert edit.original_text[cs:ce] == needle
        assert tok.decode(edit.original_ids[ts:te].tolist()) == needle
    # The deleted span is the deleted needle's block plus one blank-line separator.
    a, b = case.deleted_char_span
    assert edit.deleted_char_span == (a, b)
    deleted = NEEDLE_TEMPLATE.format(key=key, value=case.values[case.deleted])
    assert edit.original_text[a:b] in (deleted + "\n\n", "\n\n" + deleted)
    p, q = case.deleted_token_span
    assert (p, q - p) == (edit.prefix_len, edit.deleted_len)
    assert tok.decode(edit.original_ids[p:q].tolist()) == edit.original_text[a:b]
    # Deleting the recorded span yields exactly the edited context: the prompt rendered without that needle.
    assert edit.original_text[:a] + edit.original_text[b:] == edit.edited_text
    blocks = case.documents.split("\n\n")
    blocks.remove(deleted)
    rendered, query_text, _, _ = render_chat(tok, join_blocks(blocks)[0], QUESTION_TEMPLATE.format(key=key),
                                             instruction=NIAH_INSTRUCTION)
    assert rendered == edit.edited_text
    assert tok.decode(edit.query_ids.tolist()) == query_text + ANSWER_PREFIX_TEMPLATE.format(key=key)
    assert tok(edit.edited_text, add_special_tokens=False)["input_ids"] == edit.edited_ids.tolist()
    # The kept needle's spans in the edited context.
    kept = NEEDLE_TEMPLATE.format(key=key, value=case.gold[0])
    ks, ke = case.kept_char_span
    assert edit.edited_text[ks:ke] == kept
    kt0, kt1 = case.kept_token_span
    assert tok.decode(edit.edited_ids[kt0:kt1].tolist()) == kept
    # The requested length is reached with less than one paragraph (+ template) of overshoot.
    assert 700 <= edit.num_tokens <= 700 + 160
    assert niah_scorer(case, ", ".join(case.gold)) and not niah_scorer(case, ", ".join(case.values))


def test_needle_depths_follow_the_filler(tok):
    early = build_niah_case(tok, CORPUS, context_len=1500, depths=(0.0, 0.1), delete=0, seed=1)
    late = build_niah_case(tok, CORPUS, context_len=1500, depths=(0.9, 1.0), delete=0, seed=1)
    assert early.edit.prefix_len < late.edit.prefix_len
    assert early.deleted_depth == 0.0 and late.deleted_depth == 0.9
    assert late.edit.suffix_len < early.edit.suffix_len


def test_roster_cycles_lengths_and_depths_and_is_seeded(tok):
    cases = build_niah_cases(tok, context_lens=(400, 600), depths=(0.2, 0.8), num_cases=4, seed=7, corpus=CORPUS)
    assert [c.context_len for c in cases] == [400, 600, 400, 600]
    assert [c.deleted_depth for c in cases] == [0.2, 0.2, 0.8, 0.8]
    assert [c.case_id for c in cases] == ["niah-400-000", "niah-600-001", "niah-400-002", "niah-600-003"]
    again = build_niah_cases(tok, context_lens=(400, 600), depths=(0.2, 0.8), num_cases=2, seed=7, corpus=CORPUS)
    assert [(c.key, c.values, c.edit.original_ids.tolist()) for c in again] == [
        (c.key, c.values, c.edit.original_ids.tolist()) for c in cases[:2]
    ]
    other = build_niah_cases(tok, context_lens=(400, 600), depths=(0.2, 0.8), num_cases=2, seed=8, corpus=CORPUS)
    assert [c.values for c in other] != [c.values for c in again]
    assert [c.deleted for c in cases] == [1, 0, 1, 0]  # balanced: second, first, second, first needle deleted
    for c in cases:
        kept_depth = c.depths[1 - c.deleted]
        assert 0.05 <= kept_depth <= 0.95 and abs(kept_depth - c.deleted_depth) >= 0.05
        assert c.meta()["deleted_depth"] == c.deleted_depth
        sc = c.sweep_case()
        assert (sc.case_id, sc.gold, sc.edit) == (c.case_id, c.gold, c.edit)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"context_len": 10}, "context_len"),
        ({"depths": (0.2, 1.5)}, "depths"),
        ({"delete": 2}, "delete"),
    ],
)
def test_builder_rejects_bad_arguments(tok, kwargs, match):
    args = {"context_len": 500, "depths": (0.2, 0.8), "delete": 0, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_niah_case(tok, CORPUS, **args)


def test_builder_rejects_a_corpus_too_small(tok):
    with pytest.raises(ValueError, match="corpus"):
        build_niah_case(tok, CORPUS[:2], context_len=5000, depths=(0.2, 0.8), delete=0, seed=0)
    with pytest.raises(ValueError, match="num_cases"):
        build_niah_cases(tok, num_cases=0, corpus=CORPUS)


@pytest.mark.slow
def test_builder_on_the_embedded_tokenizer_and_wikipedia_filler(smol_tokenizer):
    cases = build_niah_cases(smol_tokenizer, context_lens=(1024,), depths=(0.3, 0.7), num_cases=2, seed=0)
    for case in cases:
        edit = case.edit
        a, b = case.deleted_char_span
        assert edit.original_text[:a] + edit.original_text[b:] == edit.edited_text
        # Token segments (issue 13): head and each paragraph tokenized on its own (the head ends with the only blank
        # line before the documents), so the edited ids are the segment tokenization of the edited text.
        cuts = passage_cuts(edit.edited_text)
        bounds = [0, *cuts, len(edit.edited_text)]
        pieces = [edit.edited_text[x:y] for x, y in zip(bounds, bounds[1:])]
        seg_ids, _ = tokenize_segments(smol_tokenizer, pieces)
        assert [t for seg in seg_ids for t in seg] == edit.edited_ids.tolist()
        for (ts, te), value in zip(case.needle_token_spans, case.values):
            assert smol_tokenizer.decode(edit.original_ids[ts:te].tolist()) == NEEDLE_TEMPLATE.format(
                key=case.key, value=value
            )
        assert 1024 <= edit.num_tokens <= 1024 + 400


def test_answer_target_is_the_retained_value_after_the_answer_prefix(tokenizer):
    """Every NIAH record gets gold_nll and gold_margin (issues 25, 26): the answer target is the retained value as the
    model writes it after RULER's answer prefix ("...are:" + " 1234567"), and only that value."""
    cases = build_niah_cases(tokenizer, context_lens=(256,), depths=(0.3, 0.7), num_cases=2, seed=0)
    for case in cases:
        query = tokenizer.decode(case.edit.query_ids.tolist())
        assert query.rstrip().endswith(":")
        ids = case.answer_ids
        assert ids and tokenizer.decode(list(ids)) == " " + case.gold[0]
        # The deleted value is not the target: the edited answer is the kept needle's value alone.
        assert case.values[case.deleted] not in tokenizer.decode(list(ids))
        assert case.sweep_case().answer_ids == ids


def test_erratum_deletion_note_names_the_withdrawn_needle(tokenizer):
    """Both needles share their first words ("One of the special magic numbers for KEY is:"), so a note quoting a
    fixed six-word excerpt cannot say which one is withdrawn (issue 40). The note quotes the deleted needle up to its
    value: it names the withdrawn value and not the kept one, whichever needle is deleted."""
    from sur_lab.executors import ErratumTemplates, erratum_note

    cases = build_niah_cases(tokenizer, context_lens=(256,), depths=(0.3, 0.7), num_cases=4, seed=0)
    assert {c.deleted for c in cases} == {0, 1}
    for case in cases:
        withdrawn, kept = case.values[case.deleted], case.values[1 - case.deleted]
        note = erratum_note(case.edit)
        assert withdrawn in note and kept not in note, note
        assert f"for {case.key} is: {withdrawn}" in note  # the needle's own words, up to its value
        # The fixed excerpt (distinct=False) is the same for both needles: it names neither.
        fixed = erratum_note(case.edit, templates=ErratumTemplates(distinct=False))
        assert withdrawn not in fixed and kept not in fixed
        assert " ".join(fixed.split('"')[1].removesuffix("...").split()) in " ".join(case.edit.edited_text.split())
    with pytest.raises(ValueError, match="distinct"):
        ErratumTemplates(distinct=1)


# ---------------------------------------------------------------------------------------------------------------------
# Paired differences (notebook 02)


def _paired_records(sur_em, shift_em, reprefill_em):
    rows = []
    for i, (a, s, r) in enumerate(zip(sur_em, shift_em, reprefill_em)):
        case = {"case_id": f"c{i}", "context_len": 1024}
        rows.append({**case, "method": "Shift", "budget_pct": float("nan"), "em": bool(s)})
        rows.append({**case, "method": "Re-prefill", "budget_pct": float("nan"), "em": bool(r)})
        rows.append({**case, "method": "SUR", "budget_pct": 5.0, "em": bool(a)})
    return pd.DataFrame(rows)


def test_paired_differences_values_and_decisions():
    from sur_lab.studies.niah import ALL_AGAINST_REFERENCES, paired_differences

    # SUR right on the 4 cases Shift got wrong, equal to Re-prefill on every case.
    records = _paired_records([1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1, 0, 1], [1] * 8)
    table = paired_differences(records, n_boot=500, seed=1).set_index("baseline")
    assert list(table.index) == ["Shift", "Re-prefill"]
    assert table.loc["Shift", "delta"] == pytest.approx(50.0)
    assert table.loc["Shift", "n"] == 8 and table.loc["Shift", "n_discordant"] == 4
    assert 0.0 < table.loc["Shift", "delta_low"] < 50.0 < table.loc["Shift", "delta_high"] <= 100.0
    # 4 discordant cases, all one way: exact p = 0.125, so not separated although the interval excludes 0.
    assert table.loc["Shift", "p"] == pytest.approx(0.125) and table.loc["Shift", "verdict"] == "not separated"
    # Equal on every case: 0 pp with a nonzero-width interval, never a zero-width one.
    assert table.loc["Re-prefill", "delta"] == 0.0
    assert table.loc["Re-prefill", "delta_low"] < 0 < table.loc["Re-prefill", "delta_high"]
    assert (table["family"] == ALL_AGAINST_REFERENCES.name).all() and (table["family_size"] == 2).all()
    # Every one of 8 cases better by one: exact p 2 / 2**8, alone in its family: beats (Holm over 1).
    all_better = paired_differences(_paired_records([1] * 8, [0] * 8, [1] * 8), baselines=("Shift",), n_boot=200)
    assert all_better["delta"].iloc[0] == 100.0 and all_better["delta_low"].iloc[0] < 100.0
    assert all_better["verdict"].iloc[0] == "beats"
    assert paired_differences(_paired_records([1] * 8, [0] * 8, [1] * 8), baselines=("Shift",), n_boot=200,
                              decide=False)["verdict"].iloc[0] == "not decided"


def test_declared_families_and_the_conclusion():
    from sur_lab.studies import niah

    rows = []
    for i in range(12):
        case = {"case_id": f"c{i}", "context_len": 1024}
        for method, budget, em in (("Shift", np.nan, i < 2), ("Re-prefill", np.nan, True), ("SUR", 5.0, True),
                                   ("SUR", 2.0, i < 8), ("Dense tokens", 5.0, i < 3), ("Dense tokens", 2.0, i < 3),
                                   ("Edit-local window", 5.0, i < 11), ("Erratum", np.nan, i < 6)):
            rows.append({**case, "method": method, "budget_pct": budget, "em": bool(em)})
    records = pd.DataFrame(rows)
    assert niah.family_pairs(records, niah.PRIMARY) == [("SUR 5%", "Shift")]
    assert niah.family_pairs(records, niah.RIVALS) == [
        ("SUR 2%", "Shift"), ("SUR 2%", "Re-prefill"), ("SUR 2%", "Dense tokens 2%"), ("SUR 5%", "Re-prefill"),
        ("SUR 5%", "Dense tokens 5%")]
    assert niah.family_pairs(records, niah.BEYOND) == [("Erratum", "SUR 2%"), ("Edit-local window 5%", "SUR 5%"),
                                                        ("Erratum", "SUR 5%")]  # the window ran at 5 % only
    decided = niah.decide_families(records, metric="em", n_boot=200)
    primary = decided[decided.family == niah.PRIMARY.name].iloc[0]
    # 10 discordant cases, all for SUR: exact p = 2 / 1024, tested alone.
    assert primary.adjust == "none" and primary.p == pytest.approx(2 / 1024) and primary.verdict == "beats"
    rivals = decided[decided.family == niah.RIVALS.name].set_index("comparison")
    assert (rivals.family_size == 5).all()
    assert rivals.loc["SUR 5% vs Dense tokens 5%", "verdict"] == "beats"  # 9 discordant, p_adj 5 * 2/512
    assert rivals.loc["SUR 5% vs Re-prefill", "verdict"] == "not separated"
    lines = niah.conclusion(records, decided, metric="em", allocators=["SUR", "Dense tokens", "Edit-local window"],
                            n_boot=200)
    assert lines[0].startswith("At 2 %: SUR has the highest point estimate of 2 allocators (67 %)")
    assert lines[1].startswith("At 5 %: SUR has the highest point estimate of 3 allocators (100 %); not separated "
                               "from the next 1 (Edit-local window 92 %)")
    assert "  SUR 5% beats Shift: +83.3 pp (95 % CI" in "\n".join(lines)
    smoke = niah.decide_families(records, metric="em", decide=False, n_boot=200)
    assert (smoke.verdict == "not decided").all()


def test_paired_differences_refuses_unknown_metric_and_unpaired_cases():
    from sur_lab.studies.niah import paired_differences

    records = _paired_records([1, 0], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="metric='agree'"):
        paired_differences(records, metric="agree")
    # A case with a Shift row but no SUR row is dropped from the pair (the SUR arm defines the cases);
    # a SUR case without its Shift row is an unpaired case and refused.
    unpaired = records[~((records.case_id == "c1") & (records.method == "Shift"))]
    with pytest.raises(ValueError, match="lacks rows"):
        paired_differences(unpaired, baselines=("Shift",), n_boot=100)


def test_draw_filler_takes_blocks_until_the_length_and_passes_over_skipped_ones():
    """data.text.draw_filler, the one filler loop of NIAH and stale facts: blocks in the rng's order, one token of
    separator each, stopping once the blocks and the overhead reach the length; ceiling and skip pass blocks over."""
    from types import SimpleNamespace

    import numpy as np

    from sur_lab.data.text import draw_filler

    corpus = [SimpleNamespace(title=f"T{i}", text="w " * (i + 1)) for i in range(6)]
    count = lambda text: len(text.split())  # noqa: E731  ("Title:", "Ti", then i + 1 words)
    order = [int(i) for i in np.random.default_rng(3).permutation(6)]
    blocks, lengths, total = draw_filler(count, corpus, np.random.default_rng(3), context_len=12, overhead=2)
    expected, acc = [], 0
    for i in order:
        if acc + 2 >= 12:
            break
        expected.append(i)
        acc += (i + 3) + 1
    assert blocks == [f"Title: T{i}\n{corpus[i].text.strip()}" for i in expected]
    assert lengths == [i + 4 for i in expected] and total == acc == sum(lengths)
    kept, lens, _ = draw_filler(count, corpus, np.random.default_rng(3), context_len=100, overhead=0,
                                skip=lambda b: b.startswith("Title: T0"), ceiling=20)
    assert "Title: T0\nw" not in kept and all(n <= 20 for n in lens)
    assert sum(lens) <= 20
