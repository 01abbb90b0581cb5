"""The Study base (issue 39, item 2): the registry holds Study instances and refuses anything else; params, folder,
sweep, mde, power_line and conclusion are written once in the base; sweep returns the records, the folder and the
cases; a new study is a page of declarations (a tiny float64 model with a character tokenizer)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import types

import pytest

from conftest import make_tiny_model
from sur_lab.analysis.decisions import Family, PowerBasis, PowerDesign
from sur_lab.edits import build_edit
from sur_lab.studies import STUDIES, StudyRegistry, get_study
from sur_lab.studies.base import Report, Study, SweepResult
from sur_lab.sweeps import EVAL_BATCH, Case, sweep_folder
from test_allocators import char_tokenizer

TEXT = "Note one: the code is 4. Note two: the old code was 7. Then the notes end and the day goes on quietly."
SPAN = (25, 55)  # "Note two: the old code was 7. "


class TinyStudy(Study):
    """A whole study in declarations: one edit per case, two references and SUR at one budget."""

    name, notebook, folder_prefix = "tiny", "99_tiny", "99_tiny"
    presets = {"smoke": {"num_cases": 2, "budgets": [20], "max_new_tokens": 2}}
    fixed = {"references": ["Shift", "Re-prefill"], "allocators": ["SUR"]}
    folder_keys = {"n": "num_cases", "b": "budgets", "seed": "seed", "eb": "eval_batch"}
    scorer = staticmethod(lambda case, text: text.strip() == case.gold[0])
    power = PowerDesign("SUR 20% vs Shift on EM", Family("primary", "binary", "SUR at 20 % minus Shift on EM",
                                                         primary=True), PowerBasis(0.5, "a planning value"),
                        lambda p: p["num_cases"])

    def cases(self, tokenizer, p, seed=0):
        edit = build_edit(tokenizer, TEXT, "What is the code?", SPAN)
        return [Case(f"tiny/{seed}/{i}", edit, gold=("4",)) for i in range(p["num_cases"])]

    def sweep_cases(self, cases, p):
        return list(cases)

    def methods(self, p):
        return [*p["references"], *p["allocators"]]

    def report(self, records, p, *, decide=True):
        ran = records.groupby("method")["em"].mean()
        return Report(tables={"em": ran}, conclusion=[f"methods that ran: {', '.join(sorted(ran.index))}"])


@pytest.fixture(scope="module")
def lm():
    return dataclasses.replace(make_tiny_model("llama"), tokenizer=char_tokenizer())


def test_a_new_study_is_a_page_of_declarations():
    source = inspect.getsource(TinyStudy)
    assert len(source.splitlines()) < 35
    for fn in ("params", "folder", "sweep", "check", "mde", "power_line", "conclusion"):
        assert getattr(TinyStudy, fn) is getattr(Study, fn), fn
    study = TinyStudy()
    assert study.params("smoke") == {"references": ["Shift", "Re-prefill"], "allocators": ["SUR"], "num_cases": 2,
                                     "budgets": [20], "max_new_tokens": 2}
    assert study.params("smoke", num_cases=5, budgets=None)["num_cases"] == 5  # None keeps the preset's value
    with pytest.raises(ValueError, match="preset='default' is not one of smoke"):
        study.params("default")
    with pytest.raises(ValueError, match="num_case is not a parameter of this study"):
        study.params("smoke", num_case=3)
    effect, unit = study.mde(study.params("smoke"))
    assert math.isnan(effect) and unit == "pp"  # 2 cases never reach p < 0.05
    assert study.power_line(study.params("smoke")).startswith("Power: SUR 20% vs Shift on EM (tested alone) on 2 cases")


def test_a_study_must_implement_cases_methods_and_report():
    class Half(Study):
        def cases(self, tokenizer, p, seed=0):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_folder_and_sweep_come_from_the_base(lm, tmp_path):
    study = TinyStudy()
    p = study.params("smoke")
    where = study.folder(lm, p, seed=1, outputs=tmp_path)
    assert where == sweep_folder("99_tiny", lm, outputs=tmp_path, n=2, b=[20], seed=1, eb=EVAL_BATCH)
    assert study.folder(lm, p, seed=1, executor="packed", outputs=tmp_path).name == where.name.replace(
        f"eb-{EVAL_BATCH}_", f"eb-{EVAL_BATCH}_ex-packed_")  # a non-sequential executor is named, after the keys
    result = study.sweep(lm, preset="smoke", out=tmp_path / "run", seed=1, progress=False)
    assert isinstance(result, SweepResult)
    records, folder, cases = result
    assert folder == tmp_path / "run" and (folder / "records.parquet").is_file()
    assert [c.case_id for c in cases] == ["tiny/1/0", "tiny/1/1"]  # the cases the sweep ran, for the notebook
    assert len(records) == 2 * (2 + 1 * 1)  # cases x (references + allocators x budgets)
    assert set(records["method"]) == {"Shift", "Re-prefill", "SUR"}
    assert set(records.loc[records.method == "SUR", "budget_pct"]) == {20.0}
    lines = study.conclusion(records, p, preset="smoke")
    assert lines[0].startswith("SMOKE RUN") and lines[1] == study.power_line(p)
    assert lines[2] == "methods that ran: Re-prefill, SUR, Shift"


def test_sweep_runs_the_cases_it_is_given(lm, tmp_path, monkeypatch):
    study = TinyStudy()
    built = study.cases(lm.tokenizer, study.params("smoke"), seed=0)
    first = study.sweep(lm, preset="smoke", out=tmp_path, progress=False)
    monkeypatch.setattr(TinyStudy, "cases", lambda *a, **k: pytest.fail("cases built twice"))
    again = study.sweep(lm, preset="smoke", out=tmp_path, progress=False, cases=built)  # resumed: nothing reruns
    assert again.cases is built
    cols = ["case_id", "method", "budget_pct", "answer", "em", "case_fingerprint"]
    assert again.records[cols].equals(first.records[cols])


def test_sweep_refuses_bad_parameters_before_any_model_call():
    study = TinyStudy()
    with pytest.raises(ValueError, match="Nope"):
        study.sweep(None, preset="smoke", allocators=["Nope"])  # no model: refused by check() first
    with pytest.raises(ValueError, match="budget"):
        study.sweep(None, preset="smoke", budgets=[150])

    class OneProcess(TinyStudy):
        distributed = False

    with pytest.raises(ValueError, match="workers=2, address=None: the tiny study times requests one at a time"):
        OneProcess().sweep(None, preset="smoke", workers=2)


def test_registry_holds_study_instances_and_refuses_anything_else(monkeypatch):
    for name in STUDIES:
        study = STUDIES[name]
        assert isinstance(study, Study) and study.name == name and get_study(name) is study
    registry = StudyRegistry({})
    with pytest.raises(TypeError, match="study must be a sur_lab.studies.base.Study instance; got module"):
        registry.register(types.ModuleType("not_a_study"))
    registry.register(TinyStudy())
    assert list(registry) == ["tiny"] and isinstance(registry["tiny"], TinyStudy)
    fake = types.ModuleType("fake_study_module")
    fake.STUDY = "niah"
    monkeypatch.setitem(sys.modules, "fake_study_module", fake)
    bad = StudyRegistry({"fake": "fake_study_module", "renamed": "fake_study_module"})
    assert "fake" in bad and len(bad) == 2  # listing imports nothing
    with pytest.raises(TypeError, match="fake_study_module.STUDY must be a sur_lab.studies.base.Study instance; got "
                                        "str"):
        bad["fake"]
    fake.STUDY = TinyStudy()
    with pytest.raises(TypeError, match="fake_study_module.STUDY is named 'tiny', registered as 'renamed'"):
        bad["renamed"]
    with pytest.raises(KeyError, match="unknown study 'nope'; registered studies: fake, renamed"):
        bad["nope"]
