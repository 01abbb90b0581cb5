"""The token view (sur_lab.analysis.plotting.token_view) on a tiny model with a character tokenizer: one span per kept
token, the deleted span struck through once at its place, each repair's refreshed rows underlined (classes), the K/V
deviation from Re-prefill as a second shading, and the checks at its boundary."""

from __future__ import annotations

import dataclasses
import html
import re

import numpy as np
import pytest

from conftest import make_tiny_model
from test_allocators import char_tokenizer, text_edit
from sur_lab import Support, allowance, prepare
from sur_lab.analysis.plotting import token_pieces, token_view
from sur_lab.analysis.endpoints import row_deviation
from sur_lab.studies.staleness import DENSE_TOKENS, repair_token_view

SPAN = re.compile(r'<span class="([^"]*)"(?: style="([^"]*)")?>(.*?)</span>', re.S)


@pytest.fixture(scope="module")
def view_case():
    lm = dataclasses.replace(make_tiny_model("llama"), tokenizer=char_tokenizer())
    edit = text_edit(lm.tokenizer)
    prepared = prepare(lm, edit)
    view = repair_token_view(lm, prepared, [("Shift", None), ("SUR", 10), (DENSE_TOKENS, 10)], title="tiny")
    return lm, edit, prepared, view


def spans(markup: str):
    """(classes, style, text) of every token span of the body (the query span excluded)."""
    body = markup[markup.index('<div class="body">'):]
    return [(c.split(), s or "", html.unescape(t)) for c, s, t in SPAN.findall(body) if "tok" in c.split()]


def test_html_tokens_struck_span_and_underlined_rows(view_case):
    lm, edit, prepared, view = view_case
    p, d, S = edit.prefix_len, edit.deleted_len, edit.suffix_len
    assert view.first_row_shown() == p - view.prefix_context > 0  # nothing in the prefix recomputed or stale
    assert f"… {p - view.prefix_context} earlier tokens …" in view.html()
    assert len(spans(view.html())) == view.prefix_context + S
    view = dataclasses.replace(view, prefix_context=p)  # the whole prefix from here on
    markup = view.html()
    toks = spans(markup)
    assert len(toks) == p + S, "one span per kept token"
    assert "".join(t for _, _, t in toks) == edit.edited_text, "the kept tokens spell the edited context"
    deleted_text = edit.original_text[slice(*edit.deleted_char_span)]
    full = dataclasses.replace(view, max_deleted=d).html()
    struck = re.findall(r"<del>(.*?)</del>", full, re.S)
    assert len(struck) == 1 and html.unescape(struck[0]) == deleted_text
    assert d > view.max_deleted  # the default view elides the middle of this span: head, count, tail
    head, tail = (html.unescape(t) for t in re.findall(r"<del>(.*?)</del>", markup, re.S))
    assert deleted_text.startswith(head) and deleted_text.endswith(tail)
    assert len(head) + len(tail) == view.max_deleted  # one character per token here
    assert f"{d - view.max_deleted} more deleted tokens" in markup
    # the deleted span sits at its place: after the prefix's last token, before the suffix's first
    body = markup[markup.index('<div class="body">'):]
    starts = [m.start() for m in SPAN.finditer(body)]
    assert starts[p - 1] < body.index("<del>") < starts[p]
    for i, label in enumerate(view.labels):
        rows = [j for j, (classes, _, _) in enumerate(toks) if f"r{i}" in classes]
        assert rows == view.refreshed[label].tolist(), label
    assert view.refreshed["Shift"].size == 0
    sur = view.refreshed["SUR 10%"]
    assert sur.size == allowance(S, 10) > 0
    assert all(p <= r < p + S for r in sur), "SUR refreshes suffix rows only"
    # relevance shades exactly the suffix tokens; unit boundaries are marked inside the suffix only
    shaded = [j for j, (_, style, _) in enumerate(toks) if "background:" in style]
    assert shaded == list(range(p, p + S))
    boundaries = [j - p for j, (classes, _, _) in enumerate(toks) if "ub" in classes]
    assert boundaries == [u.start for u in prepared.get_units()[1:]]
    # one radio button per repair, the first one checked; the widget view hides them
    assert markup.count('type="radio"') == len(view.labels) and markup.count(" checked") == 1
    assert 'style="display:none"' in view.html("SUR 10%", controls=False)


def test_deviation_shading_matches_the_caches(view_case):
    lm, edit, prepared, view = view_case
    shift_dev = view.deviation["Shift"]
    assert shift_dev.shape == (edit.edited_len,)
    assert np.all(shift_dev[: edit.prefix_len] <= 1e-12), "prefix rows equal Re-prefill's"
    assert shift_dev[edit.prefix_len:].max() > 1e-6, "Shift leaves the suffix stale"
    # the SUR repair is no staler than Shift on the rows it refreshed, summed
    sur_rows = view.refreshed["SUR 10%"]
    assert view.deviation["SUR 10%"][sur_rows].sum() < shift_dev[sur_rows].sum()
    markup = view.html()
    assert "--d0:1.00" in markup, "the largest deviation (Shift's) is the full shading"
    assert row_deviation(prepared.shift_cache, prepared.shift_cache).max() == 0.0


def test_token_view_refuses_bad_input():
    pieces = list("abcdefghij")
    ok = dict(prefix_len=2, deleted_len=3, refreshed={"Shift": []})
    view = token_view(pieces, **ok)
    assert view.suffix_len == 5 and len(spans(view.html())) == 7
    with pytest.raises(ValueError, match="prefix_len"):
        token_view(pieces, **{**ok, "prefix_len": 11})
    with pytest.raises(ValueError, match="deleted_len"):
        token_view(pieces, **{**ok, "deleted_len": 0})
    with pytest.raises(ValueError, match="refreshed"):
        token_view(pieces, **{**ok, "refreshed": {}})
    with pytest.raises(ValueError, match="outside"):
        token_view(pieces, **{**ok, "refreshed": {"x": [7]}})  # rows of the edited context: [0, 7)
    with pytest.raises(ValueError, match="S=4"):
        token_view(pieces, **{**ok, "refreshed": {("SUR", 5): Support(np.array([0]), 4)}})
    with pytest.raises(ValueError, match="relevance"):
        token_view(pieces, **ok, relevance=[0.1] * 4)
    with pytest.raises(ValueError, match="deviation"):
        token_view(pieces, **ok, deviation={"Other": [0.0] * 7})
    with pytest.raises(ValueError, match="non-negative"):
        token_view(pieces, **ok, deviation={"Shift": [-1.0] * 5})
    with pytest.raises(ValueError, match="selected"):
        view.html("nope")
    # a Support maps suffix positions to rows p + i; a (method, budget) key gets method_label's label
    view = token_view(pieces, **{**ok, "refreshed": {("SUR", 5): Support(np.array([0, 4]), 5)}})
    assert view.labels == ["SUR 5%"] and view.refreshed["SUR 5%"].tolist() == [2, 6]


def test_token_pieces_decode_each_id():
    tok = char_tokenizer()
    ids = tok("ab\nc", add_special_tokens=False).input_ids
    assert token_pieces(tok, ids) == ["a", "b", "\n", "c"]


def test_widget_switches_method_and_budget(view_case):
    widgets = pytest.importorskip("ipywidgets")
    _, _, _, view = view_case
    box = view.widget()
    method, budget = box.children[0].children
    shown = box.children[1]
    assert isinstance(shown, widgets.HTML) and list(method.options) == ["Shift", "SUR", DENSE_TOKENS]
    assert 'class="c0" checked' in shown.value and 'type="radio"' in shown.value  # hidden radios drive the CSS
    method.value = DENSE_TOKENS
    assert budget.value == "Dense tokens 10%" and [o[0] for o in budget.options] == ["10%"]
    assert f'class="c{view.labels.index("Dense tokens 10%")}" checked' in shown.value


def test_edit_token_view_of_an_agent_episode(data_dir):
    from sur_lab.studies.agent_session import build_episodes, default_arms, edit_token_view
    from sur_lab.data.qa import load_qa

    lm = dataclasses.replace(make_tiny_model("llama"), tokenizer=char_tokenizer())
    episode = build_episodes(lm.tokenizer, load_qa("hotpotqa", split="dev"), 1, 2, max_doc_tokens=12)[0]
    arms = default_arms([5], debt_budget=5, debt_pct=10)
    view = edit_token_view(lm, episode, arms)  # the last edit, after the first one left stale rows behind
    assert view.labels == ["Shift", "SUR 5%", "SUR 5% + debt 10%", "Re-prefill"]
    n = view.prefix_len + view.suffix_len
    assert view.refreshed["Re-prefill"].tolist() == list(range(n)) and not view.deviation["Re-prefill"].any()
    assert view.refreshed["Shift"].size == 0
    assert view.deviation["Shift"][: view.prefix_len].max() > 0, "the first edit left stale rows before the second"
    assert view.refreshed["SUR 5% + debt 10%"].size > view.refreshed["SUR 5%"].size, "the debt pass adds rows"
    assert view.relevance is not None and len(view.relevance) == view.suffix_len
    assert view.first_row_shown() < view.prefix_len - view.prefix_context  # stale prefix rows stay in view
    with pytest.raises(ValueError, match="edit=3"):
        edit_token_view(lm, episode, arms, edit=3)
