"""Stale-fact case construction (issue 26) on the SmolLM2 and Qwen2.5 tokenizers and the shipped haystack corpus:
the old value appears exactly once before the edit and never after it; the key and values are whole token spans
tokenized as on their own; a value-update case is what ``EditSession.replace`` builds; the scorer tells a stale answer
from a wrong one; depth and distance are controlled and recorded."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from sur_lab.edits import replacement_edit, splice_replacement, tokenize_segments
from sur_lab.studies import stale_facts as sf




@pytest.fixture(scope="module")
def corpus(data_dir):
    from sur_lab.data.qa import load_corpus

    return load_corpus()


@pytest.fixture(scope="module")
def cases(tokenizer, corpus):
    # A full factorial block of 3 families x 2 asks x 2 depths x 2 distances at 256 tokens, and 6 cases at 512.
    return sf.build_stale_cases(tokenizer, context_lens=[256, 512], num_cases=30, corpus=corpus, seed=3,
                                families=sf.CONTROL_FAMILIES)


@pytest.fixture(scope="module")
def derived(tokenizer, corpus):
    # Both derived families over 2 depths x 2 distances at 256 tokens, with and without the inventory.
    return [sf.build_stale_case(tokenizer, corpus, family=f, context_len=256, edit_depth=depth, distance=dist,
                                seed=40 + i, inventory=inv)
            for i, (f, depth, dist, inv) in enumerate(
                (f, depth, dist, inv) for f in sf.DERIVED_FAMILIES for depth in (0.2, 0.5) for dist in (0.1, 0.4)
                for inv in (True, False))]


@pytest.fixture(scope="module")
def rebound(tokenizer, corpus):
    # The rebound family over 2 depths x 2 distances at 256 tokens.
    return [sf.build_stale_case(tokenizer, corpus, family="rebound_reference", context_len=256, edit_depth=depth,
                                distance=dist, seed=70 + i)
            for i, (depth, dist) in enumerate((d, r) for d in (0.2, 0.5) for r in (0.1, 0.4))]


def _count(text: str, value: str) -> int:
    return len(re.findall(rf"(?<![\w-]){re.escape(value)}(?![\w-])", text))


def _decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_old_value_once_before_the_edit_and_never_after(tokenizer, cases):
    for case in cases:
        edit = case.edit
        before = _decode(tokenizer, sf.pre_edit_context_ids(case))
        after = _decode(tokenizer, edit.edited_ids)
        assert _count(before, case.old) == 1, case.case_id
        assert _count(after, case.old) == 0, case.case_id
        assert _count(after, case.gold) == 1, case.case_id
        # The one occurrence is inside the deleted span.
        s, e = edit.deleted_char_span
        assert _count(edit.original_text[s:e], case.old) == 1
        query = _decode(tokenizer, edit.query_ids)
        assert case.old not in query and case.gold not in query and case.key in query


def test_key_and_values_are_whole_token_spans_as_on_their_own(tokenizer, cases):
    for case in cases:
        edit = case.edit
        alone = tokenize_segments(tokenizer, [" " + case.gold])[0][0]
        a, b = case.answer_token_span
        assert edit.edited_ids[a:b].tolist() == alone
        assert _decode(tokenizer, edit.edited_ids[a:b]) == " " + case.gold
        assert case.gold_token == alone[0]
        old_alone = tokenize_segments(tokenizer, [" " + case.old])[0][0]
        a, b = case.old_token_span
        assert edit.original_ids[a:b].tolist() == old_alone
        assert edit.prefix_len <= a and b <= edit.prefix_len + edit.deleted_len
        assert case.old_token == old_alone[0] != case.gold_token
        key_alone = tokenize_segments(tokenizer, [" " + case.key])[0][0]
        assert case.key_token_spans
        for a, b in case.key_token_spans:
            assert edit.edited_ids[a:b].tolist() == key_alone
        # Every value of the case has its own first token, so the first answer step tells them apart.
        firsts = {tokenize_segments(tokenizer, [" " + v])[0][0][0] for v in (*case.values.values(), case.new)}
        assert len(firsts) == len(case.values) + 1


def test_value_update_is_what_edit_session_replace_builds(tokenizer, cases, monkeypatch):
    """The case's edit equals the EditedContext that EditSession.replace builds from the context before the edit."""
    from conftest import make_tiny_model
    from sur_lab.session import EditSession

    vocab = len(tokenizer)
    lm = make_tiny_model("llama", vocab_size=vocab, layers=1, hidden=16, heads=2, kv_heads=1, head_dim=8)
    built = []
    original = EditSession._edited_context

    def spy(self, *args, **kwargs):
        edit = original(self, *args, **kwargs)
        built.append(edit)
        return edit

    monkeypatch.setattr(EditSession, "_edited_context", spy)
    replaced = [c for c in cases if c.inserted_len][:3]
    assert {c.family for c in replaced} == {"value_update", "multi_key"}
    for case in replaced:
        edit, m, p = case.edit, case.inserted_len, case.edit.prefix_len
        before = sf.pre_edit_context_ids(case)
        session = EditSession(lm, method="Shift")
        session.append(before)
        session.set_query(edit.query_ids)
        session.replace(p - m, p - m + edit.deleted_len, edit.original_ids[p - m : p])
        theirs = built[-1]
        assert torch.equal(theirs.original_ids, edit.original_ids)
        assert (theirs.prefix_len, theirs.deleted_len) == (edit.prefix_len, edit.deleted_len)
        assert torch.equal(theirs.query_ids, edit.query_ids)
        assert torch.equal(session.tokens, edit.edited_ids)
        # The same layout from ids, and from text segments.
        ids, pp, dd = splice_replacement(before, p - m, p - m + edit.deleted_len, edit.original_ids[p - m : p])
        assert torch.equal(ids, edit.original_ids) and (pp, dd) == (p, edit.deleted_len)


def test_replacement_edit_text_layout(tokenizer):
    edit = replacement_edit(tokenizer, ["Head.\n\n", "Title: A\nAlpha.\n\n"], "Old fact.\n\n", "New fact.\n\n",
                            ["Title: B\nBeta."], "\n\nQuestion: q?")
    assert edit.original_text == "Head.\n\nTitle: A\nAlpha.\n\nNew fact.\n\nOld fact.\n\nTitle: B\nBeta."
    assert edit.edited_text == "Head.\n\nTitle: A\nAlpha.\n\nNew fact.\n\nTitle: B\nBeta."
    s, e = edit.deleted_char_span
    assert edit.original_text[s:e] == "Old fact.\n\n"
    deleted = edit.original_ids[edit.prefix_len : edit.prefix_len + edit.deleted_len]
    assert _decode(tokenizer, deleted) == "Old fact.\n\n"
    with pytest.raises(ValueError, match="new"):
        replacement_edit(tokenizer, "a", "b", "", "c", "q")


def test_families_depths_and_distances_are_controlled_and_recorded(cases):
    assert {c.family for c in cases} == set(sf.CONTROL_FAMILIES)
    multi = [c for c in cases if c.family == "multi_key"]
    assert {c.key == c.edited_key for c in multi} == {True, False}
    for case in cases:
        meta = case.meta()
        assert meta["family"] == case.family and meta["gold_value"] == case.gold and meta["old_value"] == case.old
        assert meta["edit_depth_tokens"] == case.edit.prefix_len
        # the edit's lengths are Record fields; a meta key of the same name would collide with them
        assert not {"prefix_len", "deleted_len", "suffix_len"} & set(meta) and meta["gold_token"] == case.gold_token
        assert case.edit.inserted_len == case.inserted_len
        if case.family == "superseded_tool_output":
            assert case.inserted_len == 0 and case.answer_in == "suffix"
            assert case.stale_value == case.old and case.distance > 0
        elif case.key == case.edited_key:
            assert case.inserted_len > 0 and case.answer_in == "inserted" and case.distance == 0.0
            assert case.answer_distance_tokens < 0  # the new value ends the prefix
        else:
            assert case.stale_value is None and case.answer_in == "suffix" and case.distance > 0
            assert case.old in case.distractors and case.new in case.distractors
        if case.answer_in == "suffix":
            assert case.answer_distance_tokens >= 0
    # A larger requested distance puts the answer-bearing value farther from the edit (same length, family, depth).
    by = {}
    for c in cases:
        if c.answer_in == "suffix":
            by.setdefault((c.family, c.context_len, c.edit_depth), []).append((c.distance, c.answer_distance_tokens))
    assert any(max(v)[1] > min(v)[1] for v in by.values() if len({d for d, _ in v}) > 1)
    # Shallower edits leave longer suffixes.
    assert {c.context_len for c in cases} == {256, 512}
    for length in (256,):
        shallow = [c.edit.suffix_len for c in cases if c.context_len == length and c.edit_depth == 0.2]
        deep = [c.edit.suffix_len for c in cases if c.context_len == length and c.edit_depth == 0.5]
        assert np.mean(shallow) > np.mean(deep)


def test_cases_do_not_depend_on_the_roster_size(tokenizer, corpus, cases):
    few = sf.build_stale_cases(tokenizer, context_lens=[256, 512], num_cases=5, corpus=corpus, seed=3,
                               families=sf.CONTROL_FAMILIES)
    for a, b in zip(few, cases):
        assert a.case_id == b.case_id and torch.equal(a.edit.original_ids, b.edit.original_ids)


def test_a_stale_answer_is_told_apart_from_a_wrong_one():
    gold, old, others = "vega-31", "onyx-12", ("lumen-40",)
    assert sf.classify_answer(" vega-31.", gold, old, others) == "correct"
    assert sf.classify_answer(" Onyx-12.", gold, old, others) == "stale"
    assert sf.classify_answer(" onyx-13", gold, old, others) == "wrong"
    assert sf.classify_answer(" onyx", gold, old, others) == "wrong"
    assert sf.classify_answer(" lumen-40", gold, old, others) == "distractor"
    assert sf.classify_answer(" vega-31, formerly onyx-12", gold, old, others) == "mixed"
    assert sf.classify_answer("", gold, old, others) == "wrong"
    assert sf.classify_answer(" onyx-12", gold, None, ("onyx-12",)) == "distractor"  # an untouched-key query


def test_scorer_on_a_case(tokenizer, cases):
    case = next(c for c in cases if c.stale_value is not None)
    assert sf.stale_fact_scorer(case, f" {case.gold}.")
    assert not sf.stale_fact_scorer(case, f" {case.old}.")
    assert sf.is_stale_answer(case, f" {case.old}.") and not sf.is_stale_answer(case, " nothing")
    swept = case.sweep_case()
    assert swept.gold == (case.gold,) and swept.meta["stale_value"] == case.old and swept.edit is case.edit
    # The sweep hands the scorer its Case: the same classes from the meta.
    for other in cases:
        for text in (f" {other.gold}.", f" {other.old}.", " nothing", f" {other.gold} or {other.new}"):
            assert sf.answer_class(other.sweep_case(), text) == sf.answer_class(other, text)
    assert sf.stale_fact_scorer(swept, f" {case.gold}.") and sf.is_stale_answer(swept, f" {case.old}")


def test_presets_and_bad_arguments(tokenizer, corpus):
    assert set(sf.PRESETS) == {"smoke", "default", "paper"}
    assert sf.PRESETS["default"]["num_cases"] >= 48 and sf.PRESETS["paper"]["num_cases"] >= 400
    assert min(sf.PRESETS["paper"]["context_lens"]) == 1024 and max(sf.PRESETS["paper"]["context_lens"]) == 8192
    with pytest.raises(ValueError, match="family"):
        sf.build_stale_case(tokenizer, corpus, family="x", context_len=256, edit_depth=0.2, seed=0)
    with pytest.raises(ValueError, match="context_len"):
        sf.build_stale_case(tokenizer, corpus, family="value_update", context_len=64, edit_depth=0.2, seed=0)
    with pytest.raises(ValueError, match="distance"):
        sf.build_stale_case(tokenizer, corpus, family="superseded_tool_output", context_len=256, edit_depth=0.8,
                            distance=0.3, seed=0)
    with pytest.raises(ValueError, match="num_keys"):
        sf.build_stale_case(tokenizer, corpus, family="multi_key", context_len=256, edit_depth=0.2, num_keys=1,
                            seed=0)
    with pytest.raises(ValueError, match="num_cases"):
        sf.build_stale_cases(tokenizer, num_cases=0, corpus=corpus)
    with pytest.raises(ValueError, match="families"):
        sf.build_stale_cases(tokenizer, families=("nope",), corpus=corpus)


def test_smoke_preset_roster(tokenizer, corpus):
    roster = sf.stale_cases(tokenizer, "smoke", corpus=corpus)
    assert len(roster) == sf.PRESETS["smoke"]["num_cases"]
    assert [c.family for c in roster] == list(sf.FAMILIES)
    assert len(sf.stale_cases(tokenizer, "smoke", corpus=corpus, num_cases=1)) == 1
    with pytest.raises(ValueError, match="budgets is not a case size"):
        sf.stale_cases(tokenizer, "smoke", corpus=corpus, budgets=[2])
    with pytest.raises(ValueError, match="preset"):
        sf.stale_cases(tokenizer, "large", corpus=corpus)


# ---------------------------------------------------------------------------------------------------------------------
# Stale facts v2 (issue 40): answer-bearing text downstream of the edit, the placement control


def _value_of(text: str, family: str, key: str) -> list[str]:
    """The values the text assigns to ``key``'s deploy target (a fact block, or a get_deploy_target tool output)."""
    pattern = (rf"deploy target for service {re.escape(key)} is ([\w-]+)\." if family == "derived_record" else
               rf"get_deploy_target for service {re.escape(key)} returned the deploy target ([\w-]+)\.")
    return re.findall(pattern, text)


def test_derived_answer_bearing_text_is_downstream_of_the_edit_and_refers_to_it(tokenizer, derived):
    assert {c.family for c in derived} == set(sf.DERIVED_FAMILIES)
    for case in derived:
        edit, p = case.edit, case.edit.prefix_len
        a, b = case.bearing_token_span
        assert p <= a < b <= edit.edited_len, case.case_id  # in the suffix: computed after the edited block
        assert case.answer_in == "suffix" and case.answer_distance_tokens == a - p >= 0
        bearing = _decode(tokenizer, edit.edited_ids[a:b])
        # It refers to the edited key without restating any value: its states carry the value only through attention.
        assert case.edited_key in bearing
        assert all(_count(bearing, v) == 0 for v in (case.old, case.new, *case.others))
        # The question reaches it: it asks the derived service, or the note's plan.
        query = _decode(tokenizer, edit.query_ids)
        asked = case.key if case.family == "derived_record" else "release of service " + case.key
        assert asked in query and asked in bearing
        if case.family == "derived_record":
            assert case.key != case.edited_key and _count(edit.edited_text, case.key) == 1
        # The same block, with the same tokens, in the context before the edit (downstream of the old block there).
        before = _decode(tokenizer, sf.pre_edit_context_ids(case))
        assert before.find(bearing.strip()) > before.find(case.old)


def test_derived_gold_value_changes_with_the_edit(tokenizer, derived):
    for case in derived:
        before = _decode(tokenizer, sf.pre_edit_context_ids(case))
        after = _decode(tokenizer, case.edit.edited_ids)
        assert case.gold == case.new != case.old and case.stale_value == case.old
        # The edited key's value: the old one before the edit, the new one after it (the derived answer follows it).
        assert _value_of(before, case.family, case.edited_key) == [case.old]
        assert _value_of(after, case.family, case.edited_key) == [case.gold]
        # Outside the inventory (the old value in another role), the old value is gone after the edit.
        listed = re.findall(r"list_deploy_targets returned ([^\n]*)\.", after)
        assert _count(after, case.old) == len(listed) and _count(before, case.old) == 1 + len(listed)
        if listed:
            assert sorted(listed[0].split(", ")) == sorted([case.old, case.new, *case.others])
        # The answer and stale spans are whole tokens: the new value ends the prefix, the old one is deleted.
        p, m, d = case.edit.prefix_len, case.inserted_len, case.edit.deleted_len
        ga, gb = case.answer_token_span
        assert p - m <= ga < gb <= p and _decode(tokenizer, case.edit.edited_ids[ga:gb]) == " " + case.gold
        oa, ob = case.old_token_span
        assert p <= oa < ob <= p + d and _decode(tokenizer, case.edit.original_ids[oa:ob]) == " " + case.old
        assert case.old_token != case.gold_token
        meta = case.meta()
        assert meta["stale_value"] == case.old and case.old not in meta["distractor_values"].split(",")
        assert sf.answer_class(case, f" {case.old}.") == "stale" and sf.answer_class(case, f" {case.gold}") == "correct"
        assert all(sf.answer_class(case, f" {v}") == "distractor" for v in case.others)


def test_placement_control_moves_the_inserted_block_before_the_question(tokenizer, derived, rebound, cases):
    from collections import Counter

    replaced = [c for c in [*derived, *rebound, *cases] if c.inserted_len]
    assert {c.family for c in replaced} == {"value_update", "multi_key", *sf.DERIVED_FAMILIES, *sf.REBOUND_FAMILIES}
    for case in replaced:
        edit, ctl, m, p = case.edit, case.control_edit, case.inserted_len, case.edit.prefix_len
        inserted = edit.edited_ids[p - m : p]
        # The same token multiset as the edit's context: a permutation that puts the inserted block last.
        assert Counter(ctl.edited_ids.tolist()) == Counter(edit.edited_ids.tolist())
        assert torch.equal(ctl.edited_ids, torch.cat((edit.edited_ids[: p - m], edit.edited_ids[p:], inserted)))
        # A deletion of the old block from the context before the edit, with the inserted block appended.
        assert ctl.inserted_len == 0 and (ctl.prefix_len, ctl.deleted_len) == (p - m, edit.deleted_len)
        assert torch.equal(ctl.original_ids, torch.cat((sf.pre_edit_context_ids(case), inserted)))
        assert torch.equal(ctl.query_ids, edit.query_ids)
        # Erratum's note carries the same inserted text at the same place: right before the question.
        from sur_lab.executors import erratum_note

        assert ctl.edited_text.endswith(erratum_note(edit).split(": ", 1)[1].strip() + "\n\n")
        swept = case.control_case()
        assert swept.case_id == case.case_id + "-late" and swept.meta["layout"] == "late"
        assert case.sweep_case().meta["layout"] == "edit" and swept.edit is ctl
    deletions = [c for c in cases if not c.inserted_len]
    assert deletions and all(c.control_edit is None and c.control_case() is None for c in deletions)
    with pytest.raises(ValueError, match="inserted"):
        sf.placement_control(tokenizer, ["a"], "b", "", ["c"], "q")


def test_late_records_pair_with_the_case(tokenizer):
    import pandas as pd

    late = pd.DataFrame({"case_id": ["stale-256-003-late", "stale-256-003-late"], "method": ["Shift", "Re-prefill"]})
    out = sf.late_records(late)
    assert out["case_id"].tolist() == ["stale-256-003"] * 2
    assert out["method"].tolist() == ["Shift (late)", "Re-prefill (late)"] and late["method"][0] == "Shift"


def _pointer(text: str, key: str) -> list[str]:
    """The services whose deploy target the text says ``key`` uses (a derived record)."""
    return re.findall(rf"service {re.escape(key)} is the canary of service ([\w-]+) ", text)


def test_rebound_answer_bearing_records_are_downstream_of_the_edited_reference(tokenizer, rebound):
    """rebound_reference: the edit re-points the asked service from one referent to another; both referents' value
    records lie in the suffix (their states computed while the old reference was visible), and the gold value
    changes with the edit from the old referent's value to the new one's."""
    for case in rebound:
        edit, p, m, d = case.edit, case.edit.prefix_len, case.inserted_len, case.edit.deleted_len
        before = _decode(tokenizer, sf.pre_edit_context_ids(case))
        after = _decode(tokenizer, edit.edited_ids)
        (old_ref,), (new_ref,) = _pointer(before, case.key), _pointer(after, case.key)
        assert case.key == case.edited_key and old_ref != new_ref
        assert case.values == {old_ref: case.old, new_ref: case.new}
        assert case.gold == case.new != case.old and case.stale_value == case.old
        # The inserted block and the deleted one name services, no value.
        inserted = _decode(tokenizer, edit.edited_ids[p - m : p])
        deleted = _decode(tokenizer, edit.original_ids[p : p + d])
        assert new_ref in inserted and old_ref in deleted and case.key in inserted and case.key in deleted
        assert all(_count(x, v) == 0 for x in (inserted, deleted) for v in (case.old, case.new))
        # Each value once, in its referent's record, before and after the edit; both records in the suffix.
        for text in (before, after):
            assert re.findall(rf"deploy target for service {re.escape(old_ref)} is ([\w-]+)\.", text) == [case.old]
            assert re.findall(rf"deploy target for service {re.escape(new_ref)} is ([\w-]+)\.", text) == [case.new]
            assert _count(text, case.old) == _count(text, case.new) == 1
        ga, gb = case.answer_token_span
        assert p <= ga < gb <= edit.edited_len and _decode(tokenizer, edit.edited_ids[ga:gb]) == " " + case.gold
        oa, ob = case.old_token_span
        assert p + d <= oa < ob and _decode(tokenizer, edit.original_ids[oa:ob]) == " " + case.old
        a, b = case.bearing_token_span
        assert p <= a <= ga < gb <= b and case.answer_in == "suffix" and case.answer_distance_tokens == a - p >= 0
        assert _decode(tokenizer, edit.edited_ids[a:b]).strip() == f"Service record: the deploy target for service " \
            f"{new_ref} is {case.new}."
        query = _decode(tokenizer, edit.query_ids)
        assert case.key in query and case.old not in query and case.gold not in query
        assert sf.answer_class(case, f" {case.old}.") == "stale" and sf.answer_class(case, f" {case.gold}") == "correct"
        assert case.meta()["stale_value"] == case.old


def test_derived_wording_may_name_the_candidates(tokenizer, corpus):
    """A ``StaleTemplates.derived`` / ``note`` wording with ``{values}`` lists the case's values (the inventory's
    shuffled list) in the derived block itself, downstream of the edit; the answer and old spans stay in the edit."""
    import dataclasses

    wording = dataclasses.replace(
        sf.DEFAULT_TEMPLATES,
        derived=sf.DEFAULT_TEMPLATES.derived[:-1] + ", one of {values}.",
        note=sf.DEFAULT_TEMPLATES.note[:-1] + ", one of {values}.")
    for family in sf.DERIVED_FAMILIES:
        case = sf.build_stale_case(tokenizer, corpus, family=family, context_len=256, edit_depth=0.2, distance=0.4,
                                   seed=90, templates=wording)
        a, b = case.bearing_token_span
        bearing = _decode(tokenizer, case.edit.edited_ids[a:b])
        listed = re.findall(r"one of ([^\n]*)\.$", bearing.strip())
        assert len(listed) == 1 and sorted(listed[0].split(", ")) == sorted([case.old, case.new, *case.others])
        p, m, d = case.edit.prefix_len, case.inserted_len, case.edit.deleted_len
        ga, gb = case.answer_token_span
        assert p - m <= ga < gb <= p and p <= a
        oa, ob = case.old_token_span
        assert p <= oa < ob <= p + d
