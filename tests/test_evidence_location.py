"""Evidence-location construction (appendix 10.1) on SmolLM2's and Qwen2.5's real tokenizers: the exchange
invariants of every source's four cells, admissible control and filler content, and counted exclusions; and the
fixed-slot allocator."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sur_lab.allocators import AllocationRequest, allocate
from sur_lab.analysis.scoring import normalize_answer
from sur_lab.budget import allowance, budget_for_allowance
from sur_lab.edits import token_edit
from sur_lab.data.qa import Passage, QAExample
from sur_lab.studies.evidence_location import (
    CELLS,
    FIXED_SLOT_METHOD,
    GEOMETRIES,
    PAD_WORDS,
    PRESETS,
    Exclusion,
    Geometry,
    LocationSource,
    build_cells,
    build_panel,
    build_source,
    neutral_padding,
    special_token_ids,
    sweep_cases,
)




@pytest.fixture(scope="module")
def panel(tokenizer, data_dir):
    return build_panel(tokenizer, ["hotpotqa", "musique", "2wikimultihopqa"], geometries="quarter",
                       sources_per_dataset=2)


def _decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------------------------------------------------
# exchange invariants


def test_every_cell_of_a_source_is_matched(panel, tokenizer):
    assert len(panel.sources) == 6 and len(panel.cases) == 24
    for k, source in enumerate(panel.sources):
        cells = {(c.side, c.tail): c for c in panel.cases[4 * k : 4 * k + 4]}
        assert list(cells) == list(CELLS)
        g = source.geometry
        assert g in GEOMETRIES["quarter"]
        for (side, tail), c in cells.items():
            e = c.edit
            # Same edit index, deletion width and slot width in every cell; the planned suffix length per tail.
            assert (e.prefix_len, e.deleted_len) == (g.edit_index, g.deletion)
            assert e.suffix_len == (g.short_suffix if tail == "short" else g.long_suffix)
            assert (c.meta["slot_width"], c.meta["edit_index"]) == (g.slot_width, g.edit_index)
            assert c.case_id == f"{c.example.dataset}/{c.example.id}/{side}-{tail}"
            # Same query and answer target everywhere.
            assert torch.equal(e.query_ids, cells["upstream", "short"].edit.query_ids)
            assert c.answer_ids == cells["upstream", "short"].answer_ids and c.gold == c.example.answers
            # The canonical answer after the query is its own tokenization (the query ends in "\n").
            assert list(c.answer_ids) == tokenizer(c.example.answer, add_special_tokens=False)["input_ids"]
        w, p = g.slot_width, g.edit_index
        for tail in ("short", "long"):
            up, down = cells["upstream", tail].edit, cells["downstream", tail].edit
            assert up.suffix_len == down.suffix_len
            assert Counter(up.original_ids.tolist()) == Counter(down.original_ids.tolist())  # token multiset
            assert Counter(up.edited_ids.tolist()) == Counter(down.edited_ids.tolist())
            # The slots immediately before and after the deletion are exchanged; everything else is shared.
            assert torch.equal(up.original_ids[p - w : p], down.suffix_ids[:w])
            assert torch.equal(down.original_ids[p - w : p], up.suffix_ids[:w])
            assert torch.equal(up.original_ids[: p - w], down.original_ids[: p - w])
            assert torch.equal(up.original_ids[p : p + g.deletion], down.original_ids[p : p + g.deletion])
            assert torch.equal(up.suffix_ids[w:], down.suffix_ids[w:])
        for side in ("upstream", "downstream"):
            short, long_ = cells[side, "short"].edit, cells[side, "long"].edit
            # The long tail extends the short one after the slots: prefix, deletion and short suffix are shared.
            assert torch.equal(long_.original_ids[: short.num_tokens], short.original_ids)


def test_evidence_sits_in_the_slot_that_the_metadata_names(panel, tokenizer):
    for c in panel.cases:
        support_text = "".join(f"Title: {p.title}\n{p.text.strip()}\n\n" for p in c.example.supporting)
        e0, e1 = c.evidence_span
        assert _decode(tokenizer, c.edit.edited_ids[e0:e1]) == support_text  # untruncated, in order
        s0, s1 = c.fixed_slot
        slot = _decode(tokenizer, c.edit.suffix_ids[s0:s1])
        assert slot.startswith(support_text) == (c.side == "downstream")
        assert (c.meta["downstream_slot_role"] == "evidence") == (c.side == "downstream")
        assert (s0, s1) == (0, c.source.geometry.slot_width) == (c.meta["fixed_slot_start"], c.meta["fixed_slot_end"])
        assert allowance(c.edit.suffix_len, c.fixed_slot_budget_pct) == s1 - s0 == c.fixed_slot_allowance


def test_rendered_text_is_the_chat_prompt(panel, tokenizer):
    from sur_lab.edits import render_chat

    c = panel.cases[1]
    pre, query, start, _ = render_chat(tokenizer, "DOCS", c.example.question)
    text = c.edit.original_text
    assert text.startswith(pre[:start]) and text.endswith("\n\n")
    assert (text + c.source.query_text).endswith(query[2:])
    assert _decode(tokenizer, c.edit.original_ids) == text
    assert _decode(tokenizer, c.edit.query_ids) == c.source.query_text


# --------------------------------------------------------------------------------------------------------------------
# admissible content


def _protected(example: QAExample) -> list[str]:
    checked = example.answer_type in ("span", "spans", "number")
    needles = [normalize_answer(a) for a in example.answers] if checked else []
    return [n for n in needles + [normalize_answer(p.title) for p in example.supporting] if n]


def test_control_and_filler_hold_no_alias_or_support_title(panel, tokenizer):
    special = special_token_ids(tokenizer)
    for source in panel.sources:
        ex = source.example
        protected = _protected(ex)
        controls = [s for s in source.control if s.kind == "control"]
        assert 1 <= len(controls) <= 4
        native = {(p.title, p.text.strip()) for p in ex.distractors}
        support_titles = {p.title for p in ex.supporting}
        for seg in controls:
            title, body = seg.text[len("Title: "):].split("\n", 1)
            assert (title, body.strip()) in native  # a native non-supporting document, whole
            assert title not in support_titles
        for region in (source.lead, source.evidence, source.control, source.deleted, source.tail, source.extension):
            for seg in region:
                assert not special & set(seg.ids)
                if seg.kind == "evidence":
                    continue
                words = f" {normalize_answer(seg.text)} "
                assert not [n for n in protected if f" {n} " in words], (seg.kind, seg.text[:60])
    # No special-token id anywhere between the chat head and the query.
    for c in panel.cases:
        assert not special & set(c.edit.original_ids[len(c.source.head):].tolist())


def test_neutral_padding_family(tokenizer):
    for k in (0, 1, 2, 7, 40):
        text = neutral_padding(tokenizer, k)
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == k
        assert text == "" or text.endswith("\n\n")
    assert neutral_padding(tokenizer, 3) == f"{PAD_WORDS[0]} {PAD_WORDS[1]}\n\n"
    with pytest.raises(ValueError, match="k"):
        neutral_padding(tokenizer, -1)


# --------------------------------------------------------------------------------------------------------------------
# exclusions


CORPUS = tuple(Passage(f"Filler {i}", f"Filler paragraph number {i} says little about anything at all here.", False)
               for i in range(200))
TINY = (Geometry(48, 160, 96, 192, 16),)


def _example(support_words: int, distractors, answer="Zanzibar", answer_type="span") -> QAExample:
    support = (Passage("Alpha", " ".join(["alpha"] * support_words) + f" {answer}.", True),
               Passage("Beta", "Beta is short.", True))
    return QAExample("x1", "Which island?", (answer,), answer_type, support, tuple(distractors), "hotpotqa")


def test_infeasible_sources_are_excluded_with_their_reason(tokenizer):
    ok = _example(3, [Passage("Gamma", "Gamma is a third thing.", False)])
    built = build_source(tokenizer, ok, TINY, corpus=CORPUS)
    assert isinstance(built, LocationSource)
    assert len(build_cells(tokenizer, built)) == 4
    wide = build_source(tokenizer, _example(200, [Passage("Gamma", "Gamma.", False)]), TINY, corpus=CORPUS)
    assert isinstance(wide, Exclusion) and wide.reason == "evidence wider than the slot"
    none = build_source(tokenizer, _example(3, []), TINY, corpus=CORPUS)
    assert isinstance(none, Exclusion) and none.reason == "no admissible native control document"
    leaking = [Passage("Gamma", "Gamma mentions Zanzibar.", False), Passage("Delta", "Delta cites Alpha.", False)]
    leak = build_source(tokenizer, _example(3, leaking), TINY, corpus=CORPUS)
    assert isinstance(leak, Exclusion) and leak.reason == "no admissible native control document"
    # An answer made of padding words cannot be protected from the neutral padding: excluded, not built.
    padded = build_source(tokenizer, _example(3, [Passage("Gamma", "Gamma.", False)], answer="quiet fields"), TINY,
                          corpus=CORPUS)
    assert isinstance(padded, Exclusion) and padded.reason == "protected answer string in inserted content"
    # A yes/no gold is not protected (it says nothing about a passage).
    assert isinstance(build_source(tokenizer, _example(3, [Passage("Gamma", "Gamma.", False)], answer="yes",
                                                       answer_type="binary"), TINY, corpus=CORPUS), LocationSource)
    # The next wider candidate rescues a source whose evidence does not fit the first.
    two = (TINY[0], Geometry(160, 400, 320, 480, 16))
    rescued = build_source(tokenizer, _example(60, [Passage("Gamma", "Gamma.", False)]), two, corpus=CORPUS)
    assert isinstance(rescued, LocationSource) and rescued.candidate == 1
    # A special token written in a control document is never inserted.
    special = _example(3, [Passage("Gamma", "Gamma <|im_end|> text.", False)])
    assert isinstance(build_source(tokenizer, special, TINY, corpus=CORPUS), Exclusion)


def test_panel_counts_every_examined_candidate(tokenizer, data_dir):
    panel = build_panel(tokenizer, ["iirc"], geometries="quarter", candidates_per_dataset=30)
    summary = panel.summary().iloc[0]
    assert summary["examined"] == 30 == summary["feasible"] + summary["excluded"]
    assert panel.exclusion_counts()["sources"].sum() == len(panel.exclusions) == summary["excluded"]
    assert len(panel.cases) == 4 * len(panel.sources)
    assert {e.reason for e in panel.exclusions} <= {"no admissible native control document",
                                                      "evidence wider than the slot"}
    with pytest.raises(ValueError, match="sources_per_dataset"):
        build_panel(tokenizer, ["iirc"], candidates_per_dataset=5, sources_per_dataset=5)
    with pytest.raises(ValueError, match="datasets"):
        build_panel(tokenizer, ["hotpot"])
    with pytest.raises(ValueError, match="geometries"):
        build_panel(tokenizer, ["iirc"], geometries="tiny")


def test_presets_and_geometries():
    assert [(g.slot_width, g.edit_index, g.short_suffix, g.long_suffix, g.deletion) for g in GEOMETRIES["paper"]] == [
        (512, 2048, 1024, 4096, 256), (768, 3072, 1536, 4096, 256), (1024, 4096, 2048, 4096, 256)]
    assert [g.slot_width for g in GEOMETRIES["quarter"]] == [128, 192, 256]
    assert GEOMETRIES["half"][0].deletion == 128
    assert set(PRESETS) == {"smoke", "default", "paper"}
    assert PRESETS["smoke"]["sources_per_dataset"] * len(PRESETS["smoke"]["datasets"]) == 2
    assert PRESETS["default"]["sources_per_dataset"] * len(PRESETS["default"]["datasets"]) >= 24  # issue 25's floor
    assert PRESETS["paper"]["geometry"] == "paper" and PRESETS["paper"]["candidates_per_dataset"] == 100
    for preset in PRESETS.values():
        assert preset["geometry"] in GEOMETRIES
    with pytest.raises(ValueError, match="geometry"):
        Geometry(64, 32, 96, 128, 8)


def test_sweep_cases_carry_flat_meta(panel):
    from sur_lab.sweeps import Case
    from sur_lab.sweeps.record import check_meta

    for sc in sweep_cases(panel.cases[:4]):
        assert isinstance(sc, Case)
        check_meta(sc.meta, sc.case_id)
        assert sc.meta["cell"] in {f"{z}/{t}" for z, t in CELLS}


# --------------------------------------------------------------------------------------------------------------------
# the fixed-slot refresh: the edit-local window at B = W


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20_000), st.data())
def test_budget_for_allowance_is_exact(s, data):
    b_pos = data.draw(st.integers(0, s))
    b = budget_for_allowance(s, b_pos)
    assert 0 <= b <= 100 and allowance(s, b) == b_pos


def test_budget_for_allowance_validation():
    assert budget_for_allowance(4096, 512) == 12.5 and budget_for_allowance(1024, 512) == 50.0
    with pytest.raises(ValueError, match="suffix_len"):
        budget_for_allowance(0, 0)
    with pytest.raises(ValueError, match="positions"):
        budget_for_allowance(10, 11)
    with pytest.raises(ValueError, match="positions"):
        budget_for_allowance(10, True)


def test_fixed_slot_refresh_covers_exactly_the_downstream_slot(panel, tokenizer):
    for c in panel.cases[:4]:
        w = c.fixed_slot_allowance
        for request in (AllocationRequest(None, c.edit, allowance=w),
                        AllocationRequest(None, c.edit, c.fixed_slot_budget_pct)):
            sel = allocate(FIXED_SLOT_METHOD, request)
            assert sel.support.intervals == [c.fixed_slot] == [(0, w)]
        suffix = c.edit.suffix_ids.tolist()
        slot = [suffix[i] for i in sel.support.positions]
        bundle = c.source.evidence if c.side == "downstream" else c.source.control
        assert slot == [i for s in bundle for i in s.ids]  # the slot's content, whichever bundle it holds
        assert c.meta["fixed_slot_allowance"] == w


def test_fixed_slot_refresh_through_the_dispatcher(tiny_lm):
    from sur_lab.repair import prepare, repair

    g = torch.Generator().manual_seed(0)
    edit = token_edit(torch.randint(1, 90, (30,), generator=g), 6, 4, [3, 4])
    res = repair(tiny_lm, prepare(tiny_lm, edit), FIXED_SLOT_METHOD, budget_for_allowance(edit.suffix_len, 5))
    assert res.support.intervals == [(0, 5)] and res.allowance == 5


# --------------------------------------------------------------------------------------------------------------------
# Tables 15-16 on synthetic records


def _long_table(seed: int = 0):
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    for d in ("a", "b"):
        for s in range(6):
            for side, tail in CELLS:
                down = side == "downstream"
                for method, nll, em in (("Shift", 2.0 + 0.5 * down + rng.normal(0, .1), rng.random() < 0.4 - .2 * down),
                                        ("Replay", 1.0 + rng.normal(0, .1), rng.random() < 0.6),
                                        ("Re-prefill", 1.0, s % 3 != 0)):
                    rows.append(("m", d, f"{d}{s}", side, tail, method, nll, bool(em)))
    return pd.DataFrame(rows, columns=["model", "dataset", "source_id", "side", "tail", "method", "gold_nll", "em"])


def test_em_stratum_keeps_units_the_reference_answers_in_all_cells():
    from sur_lab.studies.evidence_location import em_stratum

    t = _long_table()
    kept = em_stratum(t)
    assert set(kept["source_id"]) == {f"{d}{s}" for d in "ab" for s in range(6) if s % 3 != 0}
    assert len(kept) == len(t) * 8 // 12  # whole units, every method and cell
    with pytest.raises(ValueError, match="reference"):
        em_stratum(t, reference="Oracle")


def test_table15_holm_over_the_secondary_family():
    from sur_lab.analysis.stats import holm, method_difference
    from sur_lab.studies.evidence_location import SECONDARY_FAMILY, em_stratum, table15

    t = _long_table()
    nll = method_difference(t, "gold_nll", "Shift", "Replay").rename(columns={"gold_nll": "g"})
    stratum = em_stratum(t)
    em = method_difference(stratum.assign(em=stratum.em.astype(float)), "em", "Replay", "Shift")
    tab = table15(nll, em.rename(columns={"em": "g"}), n_boot=300, seed=1)
    assert len(tab) == 6
    side = tab.set_index("hypothesis").loc["NLL side"]
    assert side["estimate"] == pytest.approx(0.5, abs=0.1) and side["ci_low"] > 0 and np.isnan(side["p_adj"])
    assert side["unit"] == "nats" and side["delta"] == side["estimate"] and side["delta_low"] == side["ci_low"]
    secondary = tab[tab["hypothesis"].isin(SECONDARY_FAMILY)]
    assert secondary["p_adj"].tolist() == pytest.approx(
        list(holm(dict(zip(secondary["hypothesis"], secondary["p"]))).values()))
    from sur_lab.analysis.stats import factorial_contrasts

    raw = factorial_contrasts(em.rename(columns={"em": "g"}), "g")
    em_rows = tab[tab.endpoint == "EM"].set_index("contrast")
    assert (em_rows["kind"] == "binary").all() and (em_rows["unit"] == "pp").all()
    assert {c: em_rows["estimate"][c] for c in raw} == pytest.approx(raw)  # fractions: the decision columns
    assert {c: em_rows["delta"][c] for c in raw} == pytest.approx({c: 100 * v for c, v in raw.items()})  # points


# --------------------------------------------------------------------------------------------------------------------
# The study layer (issue 25, phase 2): the fixed-slot method, the report on synthetic records, the findings


def test_fixed_slot_method_reads_w_from_the_geometry(tiny_lm):
    from sur_lab.repair import prepare
    from sur_lab.studies.evidence_location import FixedSlotRefresh
    from sur_lab.sweeps import Method, run_case

    geometries = (Geometry(3, 8, 10, 14, 4), Geometry(5, 12, 12, 14, 4))
    method = FixedSlotRefresh(geometries)
    assert isinstance(method, Method) and np.isnan(method.budget_pct)
    g = torch.Generator().manual_seed(0)
    for p, s, w in ((8, 10, 3), (8, 14, 3), (12, 12, 5), (12, 14, 5)):
        edit = token_edit(torch.randint(1, 90, (p + 4 + s,), generator=g), p, 4, [3, 4])
        assert method.slot_width(edit) == w
        res = method.repair(tiny_lm, prepare(tiny_lm, edit), executor="sequential", seed=0)
        assert res.support.intervals == [(0, w)] and res.allowance == w
    with pytest.raises(ValueError, match="matches 0 slot widths"):
        method.slot_width(token_edit(torch.arange(1, 30), 9, 4, [3]))
    # as a sweep method: one record per case, budget NaN, allowance W
    from sur_lab.sweeps import Case

    edit = token_edit(torch.randint(1, 90, (26,), generator=g), 8, 4, [3, 4])
    recs = run_case(tiny_lm, Case("c", edit), ["Shift", "Re-prefill", method], [], max_new_tokens=2)
    fixed = recs[-1]
    assert fixed.method == "Fixed slot" and np.isnan(fixed.budget_pct) and fixed.allowance == 3
    assert fixed.positions == (0, 1, 2)


def _records(seed: int = 0, side_effect: float = 0.5, fixed_share: float = 1.0, nll_tail: float = 0.0,
             nll_side: float = 0.0, nll_noise: float = 0.2, datasets=("a", "b"), sources: int = 8,
             stratum=lambda s: s % 2 == 0):
    """Synthetic records: Shift's distance to the clean reference grows by ``side_effect`` with downstream evidence;
    Replay and the fixed slot remove (all / ``fixed_share`` of) it, up to small noise (each misses the clean answer
    on a tenth of the cells at random); Shift's gold NLL is higher by 0.3 nats, plus ``nll_tail`` in the long cells
    and ``nll_side`` in the downstream ones (a planted NLL side contrast of ``-nll_side``: Replay helps less there),
    with noise ``nll_noise`` per record; Re-prefill's EM is right on the sources ``stratum`` picks."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    for d in datasets:
        for s in range(sources):
            for side, tail in CELLS:
                down = side == "downstream"
                shift_tv = 0.2 + side_effect * down + rng.normal(0, 0.01)
                fixed_tv = max(0.0, shift_tv * (1 - fixed_share) * down + 0.001 + rng.normal(0, 0.005))
                fixed_agree = not (down and rng.random() < 1 - fixed_share) and rng.random() > 0.1
                for method, tv, seq in (("Shift", shift_tv, not down),
                                        ("Replay", abs(rng.normal(0, 0.005)), rng.random() > 0.1),
                                        ("Re-prefill", 0.0, True), ("Fixed slot", fixed_tv, fixed_agree)):
                    shift_nll = 0.3 + nll_tail * (tail == "long") - nll_side * down
                    rows.append({"model": "m", "dataset": d, "source_id": f"{d}{s}", "side": side, "tail": tail,
                                 "method": method, "budget_pct": np.nan,
                                 "em": {"Re-prefill": stratum(s), "Shift": not down}.get(method, True),
                                 "gold_nll": 1.0 + rng.normal(0, nll_noise) + (shift_nll if method == "Shift" else 0.0),
                                 "tv_reprefill": tv, "jsd_reprefill": tv / 4, "argmax_agree": seq,
                                 "sequence_agree": seq})
    return pd.DataFrame(rows)


def test_report_tables_on_synthetic_records():
    from sur_lab.analysis.stats import factorial_contrasts
    from sur_lab.studies.evidence_location import (advantage, cell_means, factorial_table, findings,
                                                   results_table, slot_gap_table, table16)

    t = results_table(_records())
    t15 = factorial_table(t, n_boot=400, seed=1)
    assert len(t15) == 12 and set(t15["condition"]) == {"Replay", "Fixed slot"}
    nll = t15[(t15.condition == "Replay") & (t15.hypothesis == "NLL side")].iloc[0]
    oracle = factorial_contrasts(advantage(t, "Replay", "gold_nll", sign=-1.0), "g")["side"]
    assert nll.estimate == pytest.approx(oracle) and nll.ci_low <= 0 <= nll.ci_high  # no NLL side effect was planted
    assert nll.ci_low < nll.tost_low <= nll.estimate <= nll.tost_high < nll.ci_high  # the 90 % interval inside the 95 %
    em = t15[(t15.condition == "Replay") & (t15.hypothesis == "EM side")].iloc[0]
    assert em.n_clusters == em.n == 8  # the stratum: even sources, where Re-prefill is right in every cell
    t16 = table16(t, n_boot=400, seed=1)
    assert len(t16) == 10
    tv = t16[(t16.endpoint == "First-token TV") & (t16.condition == "Replay")].iloc[0]
    assert tv.estimate == pytest.approx(0.5, abs=0.02) and tv.ci_low > 0
    seq = t16[(t16.endpoint == "Sequence agreement") & (t16.condition == "Fixed slot")].iloc[0]
    assert seq.estimate == pytest.approx(1.0, abs=0.15) and seq.delta == pytest.approx(100 * seq.estimate)
    assert (seq.kind, seq.unit, tv.unit) == ("binary", "pp", "")  # Shift disagrees exactly in the downstream cells
    means = cell_means(t)
    assert len(means) == 16 and (means["sources"] == 16).all()
    gaps = slot_gap_table(t, n_boot=400, seed=1)
    assert list(gaps.endpoint) == ["First-token TV", "First-token JSD", "Argmax agreement", "Sequence agreement"]
    assert list(gaps.unit) == ["", "", "pp", "pp"] and (gaps.n == gaps.n_clusters).all()
    # With noise 0.2 nats per record over 16 sources, the NLL side interval is wider than ±0.1: not separated, and
    # the null is not "reproduced" from the absence of evidence.
    found = findings(t15, t16, gaps).set_index("finding")
    assert found.loc["NLL side contrast null", "reproduced"] is None
    assert found.loc["NLL side contrast null", "verdict"] == "not separated, interval wider than the margin"
    assert found.loc["EM side contrast positive", "reproduced"] is True
    assert found.loc["fixed-slot refresh carries the side effect", "reproduced"] is True
    # Less noise: the interval fits inside the margin, and the null is reproduced as an equivalence.
    quiet = results_table(_records(nll_noise=0.05))
    found = findings(factorial_table(quiet, n_boot=400, seed=1), table16(quiet, n_boot=400, seed=1),
                     slot_gap_table(quiet, n_boot=400, seed=1)).set_index("finding")
    assert found.loc["NLL side contrast null", "reproduced"] is True
    assert found.loc["NLL side contrast null", "verdict"] == "equivalent within ±0.1 nats"
    # a fixed slot that removes only half of the side effect does not carry it (the paired difference separates)
    t_half = results_table(_records(fixed_share=0.5))
    verdicts = findings(factorial_table(t_half, n_boot=200, seed=1), table16(t_half, n_boot=200, seed=1),
                        slot_gap_table(t_half, n_boot=200, seed=1))
    assert verdicts.set_index("finding").loc["fixed-slot refresh carries the side effect", "reproduced"] is False
    # Without the paired difference the fixed-slot finding is undecided, and a smoke run decides nothing.
    assert findings(t15, t16).set_index("finding").loc["fixed-slot refresh carries the side effect",
                                                       "reproduced"] is None
    smoke = findings(t15, t16, gaps, decide=False)
    assert smoke["reproduced"].isna().all() and (smoke["verdict"] == "not decided at this size").all()


def test_a_small_em_stratum_decides_nothing():
    from sur_lab.studies.evidence_location import factorial_table, findings, results_table, table16

    # Five stratum sources whose EM side contrast is +1 each: the bootstrap alone would give p = 0, but no exact test
    # on five sources reaches 5 % (p >= 2 ** -4), let alone after Holm over five.
    t = results_table(_records(stratum=lambda s: s < 5, datasets=("a",), sources=8))
    t15 = factorial_table(t, ["Replay"], n_boot=200, seed=1)
    em = t15[t15.hypothesis == "EM side"].iloc[0]
    assert em.n_clusters == 5 and em.p >= 2.0**-4
    row = findings(t15, table16(t, ["Replay"], n_boot=200, seed=1)).set_index("finding").loc[
        "EM side contrast positive"]
    assert row.reproduced is None and row.verdict == "not separated at this size"
    # the evidence says why: five sources allow a smallest Holm p of 5 * 2 ** -4; the family of five needs eight
    assert "a stratum of 5 sources cannot separate (its smallest Holm p is 0.312): it needs >= 8" in row.evidence


def test_a_planted_nll_side_effect_is_not_called_a_null():
    """Issue 36: with an NLL side effect planted at 3x the paper's estimate (-0.12 nats) over 24 sources, "the NLL
    side contrast is null" (equivalence within ±0.1 nats) is found in at most 1 of 20 seeds."""
    from sur_lab.studies.evidence_location import factorial_table, findings, results_table, table16

    equivalent = 0
    for seed in range(20):
        t = results_table(_records(seed=seed, nll_side=0.12, datasets=("a", "b", "c"), sources=8))
        t15 = factorial_table(t, ["Replay"], n_boot=500, seed=seed)
        found = findings(t15, table16(t, ["Replay"], n_boot=100, seed=seed)).set_index("finding")
        equivalent += found.loc["NLL side contrast null", "reproduced"] is True
    assert equivalent <= 1


def test_an_empty_em_stratum_gives_nan_rows_and_keeps_the_holm_family():
    from sur_lab.analysis.stats import holm
    from sur_lab.studies.evidence_location import (SECONDARY_FAMILY, factorial_table, findings, results_table,
                                                   table16)

    records = _records(nll_tail=0.12)
    records.loc[records.method == "Re-prefill", "em"] = False
    t = results_table(records)
    t15 = factorial_table(t, ["Replay"], n_boot=200, seed=1)
    em = t15[t15.endpoint == "EM"]
    assert em[["estimate", "ci_low", "ci_high", "p", "p_adj", "delta"]].isna().all().all()
    assert (em.n == 0).all() and (em.n_clusters == 0).all() and (em.unit == "pp").all()
    # the undefined EM members count as p = 1: the family keeps its five hypotheses (dropping them would multiply
    # the NLL tail p by two, not five)
    nll = t15[t15.endpoint == "NLL"].set_index("hypothesis")
    assert 0 < nll.loc["NLL tail", "p"] < 0.2
    five = holm({"NLL tail": nll.loc["NLL tail", "p"], "NLL interaction": nll.loc["NLL interaction", "p"],
                 "EM side": 1.0, "EM tail": 1.0, "EM interaction": 1.0}, family=SECONDARY_FAMILY)
    assert nll.loc["NLL tail", "p_adj"] == pytest.approx(five["NLL tail"])
    assert nll.loc["NLL interaction", "p_adj"] == pytest.approx(five["NLL interaction"])
    verdicts = findings(t15, table16(t, ["Replay"], n_boot=200, seed=1)).set_index("finding")["reproduced"]
    assert verdicts["EM side contrast positive"] is None
    assert verdicts["fixed-slot refresh carries the side effect"] is None
    with pytest.raises(ValueError, match="condition 'Fixed slot' has no records"):
        factorial_table(t[t.method != "Fixed slot"], n_boot=10)


# --------------------------------------------------------------------------------------------------------------------
# Across models (issue 40, item 4): the common feasible panel, the pooled bootstrap, the refusals


def _panel_file(folder, feasible, excluded=(), *, seed=0, **params):
    """A panel file as :func:`panel_record` writes it (one dataset "d"), for folders swept on synthetic cases."""
    import json

    from sur_lab.studies.evidence_location import NAME, PANEL_FILE

    p = {"datasets": ["d"], "geometry": "quarter", "budgets": [5], **params}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PANEL_FILE).write_text(json.dumps(
        {"study": NAME, "params": p, "seed": seed,
         "candidates": {"d": {"feasible": list(feasible), "excluded": list(excluded)}}}))
    return folder


def _location_cases(sources, seed: int = 0):
    """Four cells per source on random tokens (p = 8, d = 4, S = 10 / 14), with the meta the report reads."""
    from sur_lab.sweeps import Case

    g = torch.Generator().manual_seed(seed)
    out = []
    for s in sources:
        for side, tail in CELLS:
            suffix = 10 if tail == "short" else 14
            edit = token_edit(torch.randint(1, 96, (8 + 4 + suffix,), generator=g), 8, 4,
                              torch.randint(1, 96, (4,), generator=g))
            out.append(Case(f"d/{s}/{side}-{tail}", edit, gold=("x",), answer_ids=(5, 7),
                            meta={"dataset": "d", "source_id": s, "side": side, "tail": tail, "cell": f"{side}/{tail}",
                                  "geometry": "8/8/10/14/4"}))
    return out


def _run(lm, folder, sources, **kwargs):
    from sur_lab.sweeps import run_sweep

    run_sweep(lm, _location_cases(sources), ["Shift", "Replay", "Re-prefill"], [], folder, progress=False,
              max_new_tokens=kwargs.pop("max_new_tokens", 2), **kwargs)
    return folder


def test_common_panel_is_the_intersection_of_feasible_sources():
    from sur_lab.studies.evidence_location import EXCLUDED, FEASIBLE, NOT_EXAMINED, common_panel

    a = {"candidates": {"x": {"feasible": ["s1", "s2", "s3", "s5"], "excluded": ["s4"]},
                        "y": {"feasible": ["t1"], "excluded": []}}}
    b = {"candidates": {"x": {"feasible": ["s2", "s3", "s4"], "excluded": ["s1"]},
                        "y": {"feasible": ["t1", "t2"], "excluded": []}}}
    c = {"candidates": {"x": {"feasible": ["s3", "s2"], "excluded": []}, "y": {"feasible": ["t1"], "excluded": []}}}
    panel = common_panel({"A": a, "B": b})
    assert panel[panel.common][["dataset", "source_id"]].values.tolist() == [["x", "s2"], ["x", "s3"], ["y", "t1"]]
    status = panel.set_index("source_id")
    assert status.loc["s1", ["A", "B"]].tolist() == [FEASIBLE, EXCLUDED]
    assert status.loc["s4", ["A", "B"]].tolist() == [EXCLUDED, FEASIBLE]
    assert status.loc["s5", ["A", "B"]].tolist() == [FEASIBLE, NOT_EXAMINED]  # B stopped before it: not common
    assert status.loc["t2", ["A", "B"]].tolist() == [NOT_EXAMINED, FEASIBLE]
    three = common_panel({"A": a, "B": b, "C": c})
    assert set(three.loc[three.common, "source_id"]) == {"s2", "s3", "t1"}
    assert common_panel({"A": a}).common.sum() == 5  # one run: its own feasible sources
    with pytest.raises(ValueError, match="panels is empty"):
        common_panel({})
    with pytest.raises(ValueError, match="candidates"):
        common_panel({"A": {"params": {}}})


def test_panel_record_lists_every_examined_candidate(panel):
    from sur_lab.studies.evidence_location import STUDY, panel_record

    p = STUDY.params("default", datasets=["hotpotqa", "musique", "2wikimultihopqa"], sources_per_dataset=2)
    rec = panel_record(panel, p, seed=0)
    assert "n_boot" not in rec["params"] and rec["params"]["sources_per_dataset"] == 2 and rec["seed"] == 0
    for d, n in panel.candidates.items():
        outcome = rec["candidates"][d]
        assert outcome["feasible"] == [s.example.id for s in panel.sources if s.example.dataset == d]
        assert len(outcome["feasible"]) == 2 and len(outcome["feasible"]) + len(outcome["excluded"]) == n
    with pytest.raises(ValueError, match="built holds sources"):
        panel_record(panel, {**p, "datasets": ["hotpotqa"]}, seed=0)


def test_combine_pools_runs_on_the_common_panel_and_refuses_other_differences(tmp_path):
    import shutil

    from conftest import make_tiny_model
    from sur_lab.studies.evidence_location import combine, pooled_report, results_table

    llama, qwen = make_tiny_model("llama"), make_tiny_model("qwen3", seed=1)
    a = _panel_file(_run(llama, tmp_path / "a", ["s0", "s1", "s2"]), ["s0", "s1", "s2"], ["s3"])
    b = _panel_file(_run(qwen, tmp_path / "b", ["s1", "s2", "s3"]), ["s1", "s2", "s3"], ["s0"])
    pooled = combine([a, b])
    assert pooled.models == ("tiny-llama", "tiny-qwen3")
    per_model = pooled.records.groupby("model")["source_id"].unique()
    assert {m: sorted(v) for m, v in per_model.items()} == {"tiny-llama": ["s1", "s2"], "tiny-qwen3": ["s1", "s2"]}
    assert len(pooled.records) == 2 * 2 * 4 * 3  # models x common sources x cells x methods
    summary = pooled.summary().iloc[0]
    assert (summary["feasible: tiny-llama"], summary["feasible: tiny-qwen3"], summary["common"], summary["units"],
            summary["dropped"], summary["built at another geometry"]) == (3, 3, 2, 4, 2, 0)
    report = pooled_report(pooled, n_boot=200, seed=1)
    side = report["table15"].set_index("hypothesis").loc["NLL side"]
    assert (side["n_clusters"], side["n"]) == (2, 4)
    assert "(4 source-model units)" in report["findings"].set_index("finding").loc["NLL side contrast null",
                                                                                   "evidence"]
    from sur_lab.analysis.stats import factorial_contrasts
    from sur_lab.studies.evidence_location import advantage

    table = results_table(pooled.records)
    assert side["estimate"] == factorial_contrasts(advantage(table, "Replay", "gold_nll", sign=-1.0), "g")["side"]
    # Another study parameter, another seed: refused, naming the parameter and both folders.
    c = tmp_path / "c"
    shutil.copytree(b, c)
    _panel_file(c, ["s1", "s2", "s3"], ["s0"], budgets=[2])
    with pytest.raises(ValueError, match=r"folders: parameter 'budgets' differs between .*a \(\[5\]\) and .*c"):
        combine([a, c])
    _panel_file(c, ["s1", "s2", "s3"], ["s0"], seed=1)
    with pytest.raises(ValueError, match="parameter 'seed' differs"):
        combine([a, c])
    # Another record fingerprint (the decoding limit), the same model twice, a repeated folder, one folder.
    d = _panel_file(_run(qwen, tmp_path / "d", ["s1", "s2", "s3"], max_new_tokens=3), ["s1", "s2", "s3"])
    with pytest.raises(ValueError, match="folders: 'max_new_tokens' differs"):
        combine([a, d])
    with pytest.raises(ValueError, match="same model"):
        combine([b, d])
    with pytest.raises(ValueError, match="repeat"):
        combine([a, b, a])
    with pytest.raises(ValueError, match=r"holds 1 folder\(s\): the pooled estimand needs the runs of >= 2 models"):
        combine([a])
    with pytest.raises(ValueError, match="list of sweep folders"):
        combine(str(a))
    # A panel file that does not match the records (an unfinished sweep), none in common, none at all.
    _panel_file(c, ["s1", "s2", "s3", "s4"], seed=0)
    with pytest.raises(ValueError, match="unfinished sweep"):
        combine([a, c])
    e = _panel_file(_run(qwen, tmp_path / "e", ["s3"]), ["s3"], ["s0", "s1", "s2"])
    with pytest.raises(ValueError, match="no feasible source in common"):
        combine([a, e])
    (c / "panel.json").unlink()
    with pytest.raises(FileNotFoundError, match="panel.json"):
        combine([a, c])
    with pytest.raises(FileNotFoundError, match="records.parquet"):
        combine([a, tmp_path / "missing"])


def _contrast_frame(model: str, values: np.ndarray, datasets=("a", "b")):
    """Per-cell advantages whose side contrast is ``values[i]`` for source i (tail and interaction 0)."""
    import pandas as pd

    rows = []
    n = len(values) // len(datasets)
    for k, d in enumerate(datasets):
        for i in range(n):
            c = float(values[k * n + i])
            for side, tail in CELLS:
                rows.append({"model": model, "dataset": d, "source_id": f"{d}{i}", "side": side, "tail": tail,
                             "g": c if side == "downstream" else 0.0})
    return pd.DataFrame(rows)


def test_the_bootstrap_carries_a_sources_cells_of_every_model_together():
    """Cluster = source across models. When two models' side contrasts agree source by source, pooling them adds no
    information: the pooled replicates are the one-model replicates exactly. Treating each (model, source) unit as
    its own cluster would double the sample and narrow the interval by about 1/sqrt(2); with models that disagree
    source by source the direction reverses (the source averages vary less than the units)."""
    import pandas as pd

    from sur_lab.studies.evidence_location import contrast_table

    rng = np.random.default_rng(3)
    c = rng.normal(0.0, 0.3, 24)

    def side(frame):
        return contrast_table({"NLL": frame}, n_boot=4000, seed=7).set_index("contrast").loc["side"]

    def by_unit(frame):  # every (model, source) its own resampling unit
        return frame.assign(source_id=frame["model"] + "/" + frame["source_id"])

    one = side(_contrast_frame("m1", c))
    same = pd.concat([_contrast_frame("m1", c), _contrast_frame("m2", c)], ignore_index=True)
    pooled = side(same)
    assert (pooled["n_clusters"], pooled["n"], one["n"]) == (24, 48, 24)
    assert pooled["estimate"] == one["estimate"]
    assert (pooled["ci_low"], pooled["ci_high"], pooled["tost_low"], pooled["tost_high"]) == \
        (one["ci_low"], one["ci_high"], one["tost_low"], one["tost_high"])
    unit = side(by_unit(same))
    assert unit["n_clusters"] == 48 and unit["estimate"] == pytest.approx(pooled["estimate"], abs=1e-15)
    ratio = (unit["ci_high"] - unit["ci_low"]) / (pooled["ci_high"] - pooled["ci_low"])
    assert 0.6 < ratio < 0.82  # about 1 / sqrt(2): the unit bootstrap overstates the sample
    opposite = pd.concat([_contrast_frame("m1", c), _contrast_frame("m2", -0.5 * c)], ignore_index=True)
    assert side(opposite)["ci_high"] - side(opposite)["ci_low"] < side(by_unit(opposite))["ci_high"] - \
        side(by_unit(opposite))["ci_low"]


def test_margin_sizing_says_how_wide_the_interval_is():
    from sur_lab.studies.evidence_location import margin_sizing

    text = margin_sizing(0.02, -0.08, 0.12, 24)
    assert "half-width 0.1 nats" in text and "leaves 0.08" in text and "about 38 sources" in text  # 24 * 1.25 ** 2
    assert "outside ±0.1 nats" in margin_sizing(-0.15, -0.3, 0.0, 24)
    with pytest.raises(ValueError, match="n_sources"):
        margin_sizing(0.0, -0.1, 0.1, 0)
    with pytest.raises(ValueError, match="tost_high"):
        margin_sizing(0.0, 0.1, -0.1, 5)
    with pytest.raises(ValueError, match="margin"):
        margin_sizing(0.0, -0.1, 0.1, 5, margin=0)


def test_min_separable_sources_is_the_exact_floor_under_holm():
    from sur_lab.analysis.decisions import p_floor
    from sur_lab.studies.evidence_location import min_separable_sources

    for size, alpha, want in ((5, 0.05, 8), (1, 0.05, 6), (1, 1 / 16, 6), (2, 0.05, 7), (5, 0.01, 10)):
        n = min_separable_sources(size, alpha)
        assert n == want and size * p_floor(n) < alpha <= size * p_floor(n - 1)
    with pytest.raises(ValueError, match="family_size"):
        min_separable_sources(0)
    with pytest.raises(ValueError, match="alpha"):
        min_separable_sources(5, 1.5)


def test_a_joint_panel_is_the_same_whichever_model_runs_it(data_dir):
    """``panel_models``: with early stopping each tokenizer alone stops at its own first feasible source (at the smoke
    sizes SmolLM2's and Qwen2.5's HotpotQA sources differ, so their runs have no source in common); with the other
    tokenizer as ``also`` both runs build the same panel, every source buildable by both."""
    from conftest import QWEN_TOKENIZER_DIR
    from transformers import AutoTokenizer

    from sur_lab.models import embedded_tokenizer
    from sur_lab.studies.evidence_location import LocationSource, panel_tokenizers

    if not (QWEN_TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"Qwen2.5 tokenizer files not found at {QWEN_TOKENIZER_DIR}")
    qwen, smol = AutoTokenizer.from_pretrained(QWEN_TOKENIZER_DIR), embedded_tokenizer()
    kw = dict(datasets=["hotpotqa", "2wikimultihopqa"], geometries="smoke", candidates_per_dataset=100,
              sources_per_dataset=1)

    def ids(p):
        return [(s.example.dataset, s.example.id) for s in p.sources]

    assert ids(build_panel(qwen, **kw)) != ids(build_panel(smol, **kw))
    a, b = build_panel(qwen, also=[smol], **kw), build_panel(smol, also=[qwen], **kw)
    assert ids(a) == ids(b) and len(ids(a)) == 2 and a.candidates == b.candidates
    for s in a.sources:
        for tok in (qwen, smol):
            assert isinstance(build_source(tok, s.example, "smoke"), LocationSource)
    assert any(e.detail.startswith("panel tokenizer 1") for e in a.exclusions)
    assert panel_tokenizers(["smollm2-135m"], smol) == [] and len(panel_tokenizers(["smollm2-135m"], qwen)) == 1
    with pytest.raises(ValueError, match="names="):
        panel_tokenizers("smollm2-135m")
