"""Issue 12, fault kinds 1, 2 and 4 as a table: one row per fault input, each with the clear error or value expected.

Kind 1, stale results reused silently: every stored result carries a fingerprint of what it depends on (model name,
weights hash, dtype, device, executor, options, decoding, case content, versions) and a mismatch is an error that names
the differing field, or a new folder / a recomputation where that is intended.
Kind 2, outputs destroyed: executed notebooks, figures and tables are written to temporary names and renamed into place;
a failed or interrupted run is kept as ``<name>.failed.ipynb`` and never replaces the last good copy; one run of a
notebook at a time; an undeclared ``-p`` is refused before anything runs. The runner rows use a throwaway notebook
written here (a few seconds each: one kernel start).
Kind 4, data accepted when it should not be: a missing ``SUR_LAB_DATA_DIR``, files that do not match the shipped
``SHA256SUMS``, corrupted files and null fields are errors naming the file (and record); held-out files are told by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import nbformat
import pytest
import torch

from conftest import make_tiny_model
from sur_lab.answer import answer, continuation_nll
from sur_lab.cache_ops import caches_equal, max_abs_diff, to_tensors
from sur_lab.edits import token_edit
from sur_lab.repair import prepare, repair
from sur_lab.fingerprint import model_fingerprint, weights_digest, weights_hash
from sur_lab.sweeps import Case, run_sweep, sweep_folder
from sur_lab.studies.noprefix import (
    build_caches,
    compose_tokens,
    composed_case,
    measure_drift,
    prefix_cache,
)

EPS64 = torch.finfo(torch.float64).eps


def _rounding(lm) -> float:
    """Relative fp64 rounding bound between two forwards of the same tokens with different row counts (GEMM rounding
    depends on the row count): per layer an inner product of length K = intermediate_size has relative error
    <= K * eps64 (Higham's gamma_K), compounding additively over the L layers."""
    cfg = lm.model.config
    return cfg.num_hidden_layers * cfg.intermediate_size * EPS64


def _max_abs(cache) -> float:
    return max(max(float(k.abs().max()), float(v.abs().max())) for k, v in to_tensors(cache))


# =====================================================================================================================
# Kind 1: stale results reused silently


def _edit(seed=0, n=40, p=6, d=5, q=4):
    g = torch.Generator().manual_seed(seed)
    return token_edit(torch.randint(3, 96, (n,), generator=g), p, d, torch.randint(3, 96, (q,), generator=g))


def _sweep(lm, out, cases=None, **kw):
    cases = cases or [Case("c0", _edit(0))]
    return run_sweep(lm, cases, ("Shift", "Re-prefill"), (), out, max_new_tokens=2, progress=False, **kw)


@pytest.fixture(scope="module")
def lm64():
    return make_tiny_model("llama", seed=0)


def _same_name_other_weights():
    return make_tiny_model("llama", seed=1)  # name "tiny-llama" too


def _same_weights_other_dtype():
    lm = make_tiny_model("llama", seed=0)
    lm.model.to(torch.float32)
    return dataclasses.replace(lm, spec=dataclasses.replace(lm.spec, dtype=torch.float32))


SWEEP_RESUME_FAULTS = [
    # (fault input, second model, expected error field)
    ("re-run with dtype changed (notebook 02 with -p dtype bfloat16)", _same_weights_other_dtype, "dtype"),
    ("extended with another model of the same name (other weights)", _same_name_other_weights, "model_weights"),
]


@pytest.mark.parametrize("label,other,field", SWEEP_RESUME_FAULTS, ids=[r[0] for r in SWEEP_RESUME_FAULTS])
def test_sweep_resume_refuses_records_of_another_model(lm64, tmp_path, label, other, field):
    first = _sweep(lm64, tmp_path)
    assert set(first["model"]) == {"tiny-llama"} and set(first["dtype"]) == {"float64"}
    assert set(first["model_weights"]) == {weights_hash(lm64)}
    second = other()
    with pytest.raises(ValueError, match=rf"out_dir=.*another {field} "):
        _sweep(second, tmp_path)
    # The intended way: sweep_folder names a new folder per model fingerprint, so the two never mix.
    a, b = sweep_folder("02_niah", lm64, outputs=tmp_path, n=1), sweep_folder("02_niah", second, outputs=tmp_path, n=1)
    assert a != b and a.parent == b.parent == tmp_path / "sweeps"
    assert sweep_folder("02_niah", lm64, outputs=tmp_path, n=1) == a  # deterministic: a re-run resumes its own folder


def test_sweep_resume_refuses_another_executor_options_and_old_records(lm64, tmp_path):
    _sweep(lm64, tmp_path)
    with pytest.raises(ValueError, match="another options"):
        _sweep(lm64, tmp_path, options={"aux_model": _same_name_other_weights()})
    with pytest.raises(ValueError, match="another seed"):
        _sweep(lm64, tmp_path, seed=5)
    # A record written before fingerprints existed (no model_weights field) is not trusted: it fails the schema, is
    # reported with its file and line, and recomputed.
    part = next((tmp_path / "parts").glob("*.jsonl"))
    recs = [json.loads(line) for line in part.read_text().splitlines()]
    part.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "model_weights"}) + "\n" for r in recs))
    with pytest.warns(UserWarning, match=r"\.jsonl:1: not a valid sweep record \(field 'model_weights' is missing"):
        again = _sweep(lm64, tmp_path)
    assert set(again["model_weights"]) == {weights_hash(lm64)}
    assert all(json.loads(line)["model_weights"] == weights_hash(lm64) for line in part.read_text().splitlines())


def test_concurrent_sweep_into_one_folder_is_refused(lm64, tmp_path):
    from filelock import FileLock

    with FileLock(str(tmp_path / ".sweep.lock")):  # another process's sweep holds the folder
        with pytest.raises(RuntimeError, match="out_dir=.*in use by another sweep"):
            _sweep(lm64, tmp_path)
    assert not (tmp_path / "parts").exists()
    assert len(_sweep(lm64, tmp_path)) == 2  # free again


def test_sweep_reference_file_of_another_model_is_recomputed(lm64, tmp_path):
    other = _same_name_other_weights()
    _sweep(lm64, tmp_path / "a")
    for part in (tmp_path / "a" / "parts").glob("*.jsonl"):  # a crash after the reference, before any record
        part.unlink()
    (tmp_path / "a" / "records.parquet").unlink()  # (and so before any consolidation)
    stale = _sweep(other, tmp_path / "a")
    fresh = _sweep(other, tmp_path / "b")
    cols = ["method", "answer", "tv_reprefill", "tv_dirty_reprefill", "nll_reprefill"]
    assert stale[cols].equals(fresh[cols])


def _prompt(prefix, docs=((11, 12, 13, 14, 15, 16, 17), (20, 21, 22, 23, 24))):
    return compose_tokens(prefix, [list(d) for d in docs], [40, 41, 42])


PREFIX_CHANGES = [
    ("prefix length 6 -> 11", [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]),
    ("same length, other tokens", [1, 2, 3, 4, 5, 6], [60, 61, 62, 63, 64, 65]),
]


@pytest.mark.parametrize("label,old,new", PREFIX_CHANGES, ids=[r[0] for r in PREFIX_CHANGES])
def test_document_store_is_keyed_by_prefix(lm64, label, old, new):
    store: dict = {}
    build_caches(lm64, _prompt(old, docs=((11, 12, 13, 14, 15, 16, 17),)), doc_store=store)
    # One document after the new prefix: composition is bitwise the full prefill (same forward, delta 0).
    single = build_caches(lm64, _prompt(new, docs=((11, 12, 13, 14, 15, 16, 17),)), doc_store=store)
    assert caches_equal(single.composed, single.full)
    assert len(store) == 2  # one cache per (prefix, document); the old prefix's cache was not reused
    # Several documents: the first document's rows equal full prefill's to fp64 rounding (a 7- vs a 12-token forward).
    prompt = _prompt(new)
    caches = build_caches(lm64, prompt, doc_store=store)
    p, (_, b0) = prompt.prefix_len, prompt.doc_bounds[0]
    assert max(max_abs_diff(caches.composed, caches.full, slice(p, p + b0))) < _rounding(lm64) * _max_abs(caches.full)


def test_prefix_cache_of_other_tokens_is_refused(lm64):
    old, new = PREFIX_CHANGES[1][1], PREFIX_CHANGES[1][2]
    with pytest.raises(ValueError, match="prefix_kv"):
        build_caches(lm64, _prompt(new), prefix_kv=prefix_cache(lm64, _prompt(old)))


def test_composed_cases_do_not_reuse_documents_across_prefixes(lm64):
    old, new = PREFIX_CHANGES[0][1], PREFIX_CHANGES[0][2]
    cases = [composed_case(f"same/{i}", _prompt(pre), meta={"source_id": "same"}) for i, pre in enumerate((old, new))]
    full = measure_drift(lm64, cases)  # both requests prepared in one process, sharing its document cache store
    assert len(full) == 2
    for drift in full["drift"]:  # relative drift of document 0: rounding only, for both prefixes
        assert drift[0] < _rounding(lm64) and drift[1] > 1e-3


def test_answer_refuses_a_cache_of_another_edit(lm64):
    short, long = _edit(0, n=20, p=4, d=2), _edit(1, n=40, p=6, d=5)  # p + S = 18 and 35 rows
    long_cache = repair(lm64, prepare(lm64, long), "Re-prefill").cache
    assert long.prefix_len + long.suffix_len == 35 and short.prefix_len + short.suffix_len == 18
    with pytest.raises(ValueError, match=r"cache has 35 rows; .*p \+ S = 18"):
        answer(lm64, long_cache, short, max_new_tokens=1)
    with pytest.raises(ValueError, match="cache has 35 rows"):
        continuation_nll(lm64, long_cache, short, [5, 6])
    # Dirty's cache (the original N rows) and every repaired cache (p + S rows) are accepted.
    prepared = prepare(lm64, short)
    assert answer(lm64, prepared.dirty_cache, short, max_new_tokens=1).token_ids
    assert answer(lm64, repair(lm64, prepared, "Shift").cache, short, max_new_tokens=1).token_ids


def test_weights_hash_is_cached_and_sees_in_place_changes(lm64):
    lm = make_tiny_model("llama", seed=0)
    h = weights_hash(lm)
    assert h == weights_hash(lm64) and weights_hash(lm) == h
    with torch.no_grad():
        next(lm.model.parameters())[0, 0] += 1e-12  # one ulp-scale change in one weight
    assert weights_hash(lm) != h
    assert model_fingerprint(lm)["dtype"] == "float64" and model_fingerprint(lm)["device"] == "cpu"


def _update_data_copy(model):
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data * 1.01)  # an RL weight sync: through .data, no version bump, same storage


def _update_data_add(model):
    for p in model.parameters():
        p.data.add_(1e-3)


def _update_load_state_dict(model):
    model.load_state_dict({k: v * 1.01 for k, v in model.state_dict().items()})


def _update_copy_inference_mode(model):
    with torch.inference_mode():
        for p in model.parameters():
            p.copy_(p * 1.01)


def _update_assign(model):
    model.load_state_dict({k: v * 1.01 for k, v in model.state_dict().items()}, assign=True)


def _update_optimizer_step(model):
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits.square().mean().backward()
    torch.optim.SGD(params, lr=1e-2).step()  # a trainer's step on the served module
    for p in params:
        p.grad = None
        p.requires_grad_(False)


def _update_vector_to_parameters(model):
    vec = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vec * 1.01, model.parameters())  # param.data = new storage


WEIGHT_UPDATES = [
    ("p.data.copy_", _update_data_copy),
    ("p.data.add_", _update_data_add),
    ("load_state_dict", _update_load_state_dict),
    ("copy_ under inference_mode", _update_copy_inference_mode),
    ("load_state_dict(assign=True)", _update_assign),
    ("optimizer step", _update_optimizer_step),
    ("vector_to_parameters", _update_vector_to_parameters),
]


@pytest.mark.parametrize("label,update", WEIGHT_UPDATES, ids=[r[0] for r in WEIGHT_UPDATES])
def test_every_store_keyed_on_the_weights_sees_an_in_place_update(label, update):
    """Issue 38: after an in-place weight update, the weights digest and hash change, the SAFE-KV document store
    encodes the documents again (never serving KV of the old weights), the sweep fingerprint changes, and an
    EditSession prefills its context again (its cache equals a fresh prefill under the new weights)."""
    from sur_lab import EditSession
    from sur_lab.forward import prefill
    from sur_lab.studies.noprefix import document_caches
    from sur_lab.sweeps.record import config_fields

    lm = make_tiny_model("llama", seed=0)
    digest0, hash0, weights0 = weights_digest(lm), weights_hash(lm), config_fields(lm)["model_weights"]
    assert weights_digest(lm) == digest0  # a check without an update changes nothing
    prompt = _prompt([1, 2, 3, 4, 5, 6])
    store: dict = {}
    build_caches(lm, prompt, doc_store=store)
    session = EditSession(lm, method="Shift")
    ids = torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(1))
    session.append(ids)

    update(lm.model)
    assert weights_digest(lm) != digest0
    assert weights_hash(lm) != hash0 and weights_hash(lm) == weights_hash(lm, full=True)
    assert config_fields(lm)["model_weights"] != weights0
    fresh = build_caches(lm, prompt, doc_store=store)
    assert len(store) == 2 * prompt.num_docs  # encoded again under the new weights
    expected = document_caches(lm, prompt, fresh.prefix)
    assert all(caches_equal(a, b) for a, b in zip(fresh.documents, expected))
    with pytest.warns(RuntimeWarning, match="weights changed since the cache was computed.*20 rows are prefilled"):
        cache = session.cache
    assert caches_equal(cache, prefill(lm, ids)[0]) and session.debt == 0
    record = session.sync(ids)  # nothing changed since: no second prefill, the prompt is unchanged
    assert record.path == "unchanged" and record.recomputed == 0


def test_a_sync_after_a_weight_update_prefills_the_new_prompt():
    from sur_lab import EditSession
    from sur_lab.forward import prefill

    lm = make_tiny_model("llama", seed=0)
    session = EditSession(lm, method="SUR", budget_pct=0)
    ids = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(2))
    session.sync(ids)
    _update_data_copy(lm.model)
    new = torch.cat((ids[:10], ids[15:], torch.tensor([7, 8])))
    record = session.sync(new)
    assert record.path == "re-prefill" and record.recomputed == len(new) and record.reused == 0
    assert caches_equal(session.cache, prefill(lm, new)[0])


# =====================================================================================================================
# Kind 2: outputs destroyed


def _write_notebook(folder: Path, body: str, name: str = "nb_fault.ipynb") -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("mode: str = 'ok'  # what the run does\nvalue: int = 1  # a number")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    nbformat.write(nb, path)
    return path


NOTEBOOK_BODY = """
import os, signal, time
print(f"result {mode} {value}")
if mode == "fail":
    raise RuntimeError("cell failed on purpose")
if mode in ("sigterm", "sigint"):
    os.kill(os.getppid(), signal.SIGTERM if mode == "sigterm" else signal.SIGINT)
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    from sur_lab.runtime.run_notebooks import run_notebook

    root = tmp_path_factory.mktemp("nbrun")
    path = _write_notebook(root / "nbs", NOTEBOOK_BODY)
    target = run_notebook(path, {"mode": "ok"}, outputs=root / "out", progress=False)
    return path, target


def _text(path: Path) -> str:
    return path.read_text()


RUN_FAULTS = [
    # (fault input, parameters, expected exception, expected marker in the failed copy)
    ("a cell fails", {"mode": "fail"}, "PapermillExecutionError", "failed: PapermillExecutionError"),
    ("SIGTERM during the run", {"mode": "sigterm"}, "RunInterrupted", "interrupted: RunInterrupted"),
    ("Ctrl-C (SIGINT) during the run", {"mode": "sigint"}, "KeyboardInterrupt", "interrupted: "),
]


# The signal cases run the notebook from a child process, which the kernel signals: a signal handler that raises in
# pytest's own process can land inside an ``ast.parse`` (pytest's assertion rewriting of a lazily imported module),
# which on CPython 3.11.7 leaves the AST recursion counter corrupted and every later ``ast.parse`` in that process
# failing with "SystemError: AST constructor recursion depth mismatch" (seen here after the SIGTERM case).
_RUN_IN_CHILD = """
import json, signal, sys
from pathlib import Path
from sur_lab.runtime.run_notebooks import run_notebook
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises here even if pytest runs under nohup
try:
    run_notebook(Path(sys.argv[1]), json.loads(sys.argv[2]), outputs=Path(sys.argv[3]), progress=False)
except BaseException as error:
    print("RAISED", type(error).__name__, isinstance(error, KeyboardInterrupt), flush=True)
    sys.exit(3)
print("RETURNED", flush=True)
"""


@pytest.mark.parametrize("label,params,exc,marker", RUN_FAULTS, ids=[r[0] for r in RUN_FAULTS])
def test_failed_or_interrupted_run_keeps_the_last_good_notebook(good_run, label, params, exc, marker):
    from sur_lab.runtime.run_notebooks import failed_path, run_notebook

    path, target = good_run
    before = _text(target)
    assert "result ok 1" in before
    if params["mode"] == "fail":
        with pytest.raises(BaseException) as info:
            run_notebook(path, params, outputs=target.parent, progress=False)
        assert type(info.value).__name__ == exc
    else:
        # Its own session, so that a hung run (and its kernel, which shares the pipes) can be killed as a group.
        child = subprocess.Popen(
            [sys.executable, "-c", _RUN_IN_CHILD, str(path), json.dumps(params), str(target.parent)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        try:
            stdout, stderr = child.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
        raised = [line.split() for line in stdout.splitlines() if line.startswith("RAISED")]
        assert child.returncode == 3 and raised, (child.returncode, stdout, stderr[-2000:])
        name, is_keyboard_interrupt = raised[0][1], raised[0][2] == "True"
        assert name == exc or (exc == "KeyboardInterrupt" and is_keyboard_interrupt), raised
    assert _text(target) == before  # the last good copy is untouched
    failed = nbformat.read(failed_path(target), as_version=4)
    assert failed.metadata["sur_lab"]["run_error"].startswith(marker)
    assert "did not finish" in failed.cells[0].source and failed.metadata["papermill"]["exception"]
    assert not list(target.parent.glob(".*.running.ipynb")) and not list(target.parent.glob(".*.tmp"))


def test_killed_run_is_recovered_as_failed_and_success_replaces_atomically(good_run):
    from sur_lab.runtime.run_notebooks import failed_path, run_notebook

    path, target = good_run
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = target.parent / f".{path.stem}.{dead.pid}.running.ipynb"  # what SIGKILL leaves behind
    shutil.copy(target, leftover)
    out = run_notebook(path, {"mode": "ok", "value": 7}, outputs=target.parent, progress=False)
    assert out == target and "result ok 7" in _text(target)
    assert not leftover.exists()
    # The killed run became <name>.failed.ipynb, then this successful run cleared the stale failure marker.
    assert not failed_path(target).exists()


def test_concurrent_run_of_the_same_notebook_is_refused(good_run):
    from filelock import FileLock

    from sur_lab.runtime.run_notebooks import NotebookBusyError, run_notebook

    path, target = good_run
    before = _text(target)
    with FileLock(str(target.parent / f".{path.stem}.lock")):
        with pytest.raises(NotebookBusyError, match="already running"):
            run_notebook(path, {"mode": "ok", "value": 9}, outputs=target.parent, progress=False)
    assert _text(target) == before


@pytest.mark.parametrize("deaths,ok", [(1, True), (2, True), (3, False)])
def test_a_kernel_that_dies_at_startup_is_started_again(tmp_path, monkeypatch, deaths, ok):
    """A kernel that loses the port race at startup (``ZMQError: Address already in use``; CI saw it with two test
    workers starting kernels at once) dies before it replies to ``kernel_info``, before any cell runs: the run starts a
    new kernel, up to ``KERNEL_START_ATTEMPTS`` in all, and then fails as any run fails."""
    from sur_lab.runtime import run_notebooks as rn

    path = _write_notebook(tmp_path / "nbs", NOTEBOOK_BODY)
    real, calls = rn.pm.execute_notebook, []

    def flaky(*args, **kwargs):
        calls.append(args[1])
        if len(calls) <= deaths:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return real(*args, **kwargs)

    monkeypatch.setattr(rn.pm, "execute_notebook", flaky)
    assert rn.KERNEL_START_ATTEMPTS == 3
    if ok:
        target = rn.run_notebook(path, {"mode": "ok", "value": 5}, outputs=tmp_path / "out", progress=False)
        assert "result ok 5" in _text(target) and len(calls) == deaths + 1
        assert not rn.failed_path(target).exists()
    else:
        with pytest.raises(RuntimeError, match="kernel_info"):
            rn.run_notebook(path, {"mode": "ok"}, outputs=tmp_path / "out", progress=False)
        assert len(calls) == 3 and not (tmp_path / "out" / path.name).exists()
    assert len(set(calls)) == 1  # every try writes the same running copy, none left behind
    assert not list((tmp_path / "out").glob(".*.running.ipynb"))


def test_kernel_start_failed_matches_only_a_death_before_any_cell():
    from sur_lab.runtime.run_notebooks import kernel_start_failed

    assert kernel_start_failed(RuntimeError("Kernel died before replying to kernel_info"))
    assert not kernel_start_failed(RuntimeError("cell failed on purpose"))
    assert not kernel_start_failed(KeyboardInterrupt())
    assert not kernel_start_failed(ValueError("Kernel died before replying to kernel_info"))


def test_undeclared_parameter_is_an_error_before_anything_runs(tmp_path, capsys):
    from sur_lab.runtime.run_notebooks import main

    path = _write_notebook(tmp_path / "nbs", NOTEBOOK_BODY)
    code = main(["--notebooks", str(path.parent), "--outputs", str(tmp_path / "out"), "-p", "budgets_pct", "5"])
    assert code == 2 and "budgets_pct" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_figures_and_tables_are_written_atomically(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from sur_lab.analysis.plotting import save_figure, save_table

    [csv] = save_table(pd.DataFrame({"a": [1, 2]}), "t", outputs=tmp_path)
    good = csv.read_text()

    class Broken(pd.DataFrame):
        def to_csv(self, path, **kw):  # a write that dies half-way
            Path(path).write_text("a\n1\n")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_table(Broken({"a": [3]}), "t", outputs=tmp_path)
    assert csv.read_text() == good
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    png, pdf = save_figure(fig, "f", outputs=tmp_path)
    plt.close(fig)
    assert png.read_bytes()[:4] == b"\x89PNG" and pdf.read_bytes()[:4] == b"%PDF"
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]


def test_tables_with_multiindex_columns_are_written_with_one_header_row(tmp_path):
    import pandas as pd

    from sur_lab.analysis.plotting import flat_columns, save_table

    # Table 12's shape: metrics x budgets, then reset_index(names="rule") adds the column ("rule", "").
    block = pd.DataFrame({"2%": [50.0, 25.0], "5%": [75.0, 100.0]}, index=["SUR", "Dense"])
    t12 = pd.concat({"agreement (%)": block, "mean R": block / 100}, axis=1).reset_index(names="rule")
    csv, parquet = save_table(t12, "t12", outputs=tmp_path, parquet=True)
    names = ["rule", "agreement (%) / 2%", "agreement (%) / 5%", "mean R / 2%", "mean R / 5%"]
    for back in (pd.read_csv(csv), pd.read_parquet(parquet)):
        assert list(back.columns) == names
        assert back["rule"].tolist() == ["SUR", "Dense"]
        assert back["agreement (%) / 5%"].tolist() == [75.0, 100.0] and back["mean R / 2%"].tolist() == [0.5, 0.25]
    assert list(t12.columns)[0] == ("rule", "")  # the caller's frame is not modified
    plain = pd.DataFrame({"a": [1]})
    assert flat_columns(plain) is plain
    clash = pd.DataFrame([[1, 2]], columns=pd.MultiIndex.from_tuples([("a", ""), ("a", "")]))
    with pytest.raises(ValueError, match=r"df: .*duplicate names \['a'\]"):
        flat_columns(clash)


# =====================================================================================================================
# Kind 4: data accepted when it should not be

HOTPOT_DEV = "hotpotqa/hotpotqa__v2_dev_random_100.jsonl"


@pytest.fixture
def data_copy(data_dir, tmp_path, monkeypatch):
    """A copy of the shipped SHA256SUMS and the HotpotQA dev file, used as SUR_LAB_DATA_DIR."""
    root = tmp_path / "qa"
    (root / "hotpotqa").mkdir(parents=True)
    shutil.copy(data_dir / "SHA256SUMS", root / "SHA256SUMS")
    shutil.copy(data_dir / HOTPOT_DEV, root / HOTPOT_DEV)
    monkeypatch.setenv("SUR_LAB_DATA_DIR", str(root))
    return root


def _truncate_lines(path: Path, keep: int) -> None:
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:keep]))


SHIPPED_FILE_FAULTS = [
    # (fault input, how the copy is damaged, expected error)
    ("empty data file", lambda r: (r / HOTPOT_DEV).write_text(""), r"hotpotqa__v2_dev_random_100.jsonl.*SHA-256"),
    ("data file truncated at a line boundary", lambda r: _truncate_lines(r / HOTPOT_DEV, 10),
     r"hotpotqa__v2_dev_random_100.jsonl.*SHA-256"),
    ("empty SHA256SUMS", lambda r: (r / "SHA256SUMS").write_text(""), r"SHA256SUMS.*is empty"),
    ("SHA256SUMS truncated mid-line", lambda r: (r / "SHA256SUMS").write_text((r / "SHA256SUMS").read_text()[:300]),
     r"SHA256SUMS.*line \d+"),
    ("SHA256SUMS truncated at a line boundary (entry lost)", lambda r: _truncate_lines(r / "SHA256SUMS", 2),
     r"hotpotqa__v2_dev_random_100.jsonl.*not listed in .*SHA256SUMS"),
]


@pytest.mark.parametrize("label,damage,match", SHIPPED_FILE_FAULTS, ids=[r[0] for r in SHIPPED_FILE_FAULTS])
def test_shipped_files_are_verified_against_sha256sums(data_copy, label, damage, match):
    from sur_lab.data.qa import load_qa

    assert len(load_qa("hotpotqa")) == 100  # the intact copy verifies
    os.utime(data_copy / HOTPOT_DEV)  # (a cached verification is keyed by size and mtime)
    damage(data_copy)
    with pytest.raises(ValueError, match=match):
        load_qa("hotpotqa")


def test_a_dataset_folder_reached_through_a_symlink_is_verified_against_its_own_sha256sums(data_copy, tmp_path):
    """Issue 38: the data folder links its dataset folder from elsewhere (another disk, a shared copy): the file is
    listed in the data folder's SHA256SUMS under the link's name, so it is found there and verified, not refused."""
    from sur_lab.data.qa import load_qa, verify_checksum

    elsewhere = tmp_path / "elsewhere" / "hotpotqa_v2"
    shutil.move(str(data_copy / "hotpotqa"), elsewhere.parent / "tmp")
    (elsewhere.parent / "tmp").rename(elsewhere)
    (data_copy / "hotpotqa").symlink_to(elsewhere, target_is_directory=True)
    assert len(load_qa("hotpotqa")) == 100
    assert verify_checksum(data_copy / HOTPOT_DEV)
    with (elsewhere / Path(HOTPOT_DEV).name).open("a") as fh:  # damaged behind the link: still refused
        fh.write("\n")
    with pytest.raises(ValueError, match=r"hotpotqa__v2_dev_random_100.jsonl.*SHA-256 .* differs"):
        load_qa("hotpotqa")


def test_data_dir_that_does_not_exist_is_an_error(monkeypatch, tmp_path):
    from sur_lab.paths import default_data_dir
    from sur_lab.data.qa import load_qa

    monkeypatch.setenv("SUR_LAB_DATA_DIR", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="SUR_LAB_DATA_DIR=.*nothing.*not a directory"):
        default_data_dir()
    with pytest.raises(FileNotFoundError, match="SUR_LAB_DATA_DIR"):
        load_qa("hotpotqa")


def _hotpot(**over):
    rec = {"_id": "h1", "question": "Who?", "answer": "Ann", "supporting_facts": [["A", 0]],
           "context": [["A", ["Ann did it."]], ["B", ["Bob did not."]]]}
    return {**rec, **over}


def _ircot(**over):
    rec = {"question_id": "i1", "question_text": "Who?", "answers_objects": [{"number": "", "spans": ["Ann"]}],
           "contexts": [{"idx": 0, "title": "A", "paragraph_text": "Ann.", "is_supporting": True}]}
    return {**rec, **over}


def _musique(**over):
    rec = {"id": "m1", "question": "Who?", "answer": "Ann", "answer_aliases": [], "answerable": True,
           "paragraphs": [{"idx": 0, "title": "A", "paragraph_text": "Ann.", "is_supporting": True}]}
    return {**rec, **over}


def _iirc(**over):
    rec = {"id": "r1", "question": "Who?", "answer_type": "spans", "answers": ["Ann"], "answerable": True,
           "main_passage": "Ann.", "gold_snippets": [], "retrieved_snippets": []}
    return {**rec, **over}


def _jsonl(*recs) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


FILE_FAULTS = [
    # (fault input, file name, bytes, expected error: file named, record named where there is one)
    ("empty file", "e.jsonl", b"", r"e\.jsonl' is empty"),
    ("whitespace only", "w.jsonl", b"\n \n", r"w\.jsonl' is empty"),
    ("truncated json list", "t.json", json.dumps([_hotpot(), _hotpot(_id="h2")]).encode()[:150],
     r"t\.json' is not a valid json list"),
    ("truncated json line", "tl.jsonl", _jsonl(_ircot(), _ircot(question_id="i2"))[:-20],
     r"tl\.jsonl' is neither a json list nor json lines: line 2"),
    ("binary garbage", "g.jsonl", bytes(range(256)) * 4, r"g\.jsonl' is not UTF-8"),
    ("empty json list", "l.json", b"[]", r"l\.json' holds no records"),
    ("hotpot null question", "hq.json", json.dumps([_hotpot(question=None)]).encode(),
     r"hq\.json'.*record 0 \(id 'h1'\) has a null 'question'"),
    ("hotpot null answer", "ha.json", json.dumps([_hotpot(), _hotpot(_id="h2", answer=None)]).encode(),
     r"ha\.json'.*record 1 \(id 'h2'\) has a null 'answer'"),
    ("ircot null question", "hotpot_iq.jsonl", _jsonl(_ircot(question_text=None)),
     r"iq\.jsonl'.*record 0 \(id 'i1'\) has a null 'question_text'"),
    ("ircot null answers", "hotpot_ia.jsonl", _jsonl(_ircot(answers_objects=None)),
     r"ia\.jsonl'.*record 0 \(id 'i1'\) has a null 'answers_objects'"),
    ("musique null answer", "ma.jsonl", _jsonl(_musique(answer=None)),
     r"ma\.jsonl'.*record 0 \(id 'm1'\) has a null 'answer'"),
    ("iirc null question", "rq.jsonl", _jsonl(_iirc(question=None)),
     r"rq\.jsonl'.*record 0 \(id 'r1'\) has a null 'question'"),
    ("empty question", "eq.json", json.dumps([_hotpot(question="  ")]).encode(),
     r"eq\.json'.*record 0 \(id 'h1'\) has an empty or non-text 'question'"),
    ("null paragraph text", "pt.jsonl", _jsonl(_musique(paragraphs=[{"idx": 0, "title": "A", "paragraph_text": None,
                                                                      "is_supporting": True}])),
     r"pt\.jsonl'.*record 0 \(id 'm1'\) is not valid musique"),
]


@pytest.mark.parametrize("label,name,data,match", FILE_FAULTS, ids=[r[0] for r in FILE_FAULTS])
def test_bad_files_name_file_and_record(tmp_path, label, name, data, match):
    from sur_lab.data.qa import load_qa

    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        load_qa(path)


def test_corpus_null_text_names_file_and_record(tmp_path):
    from sur_lab.data.qa import load_corpus

    path = tmp_path / "c.json"
    path.write_text(json.dumps([{"title": "A", "text": "x"}, {"title": "B", "text": None}]))
    with pytest.raises(ValueError, match=r"c\.json'.*corpus record 1"):
        load_corpus(path)


HELD_OUT = [
    # (fault input, path relative to tmp_path or data dir, expected is_held_out)
    ("a user file under a folder named test", "test/dev.jsonl", False),
    ("a user file whose name contains test", "my_contest_dev.jsonl", False),
    ("the held-out HotpotQA file", "hotpotqa__v2_test_random_500.jsonl", True),
    ("the held-out IIRC file", "iirc_test_normalized.jsonl", True),
    ("MuSiQue's dev sample (development + final)", "musique_ans_dev_sample.jsonl", False),
    ("a renamed copy of a held-out file", "renamed.jsonl", True),
]


@pytest.mark.parametrize("label,rel,expected", HELD_OUT, ids=[r[0] for r in HELD_OUT])
def test_held_out_is_decided_by_file_name_or_checksum(data_dir, tmp_path, label, rel, expected):
    from sur_lab.data.qa import is_held_out
    from sur_lab.studies.theory import theory_edit

    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if rel == "renamed.jsonl":
        shutil.copy(data_dir / "iirc" / "iirc_test_normalized.jsonl", path)
    else:
        path.write_text(json.dumps(_ircot()) + "\n")
    assert is_held_out(path) is expected
    with pytest.raises(Exception) as info:  # a one-record file cannot make a deletion edit either way
        theory_edit(None, str(path))
    assert ("held-out" in str(info.value)) is expected, str(info.value)


# =====================================================================================================================
# Issue 24 (robust): records without ids, an unverified data folder, and the runners' checks before any work.
# =====================================================================================================================
ID_FAULTS = [
    # (fault input, file name, bytes, expected error naming the file, the record and the id field)
    ("hotpot record without _id", "nid.json", json.dumps([_hotpot(), {k: v for k, v in _hotpot().items()
                                                                      if k != "_id"}]).encode(),
     r"nid\.json'.*record 1 has no id field '_id' \(got None\)"),
    ("hotpot null _id", "zid.json", json.dumps([_hotpot(_id=None)]).encode(),
     r"zid\.json'.*record 0 has a null, empty or non-text id field '_id'"),
    ("hotpot empty _id", "eid.json", json.dumps([_hotpot(_id="  ")]).encode(), r"record 0 has a null, empty"),
    ("hotpot boolean _id", "bid.json", json.dumps([_hotpot(_id=True)]).encode(), r"record 0 has a null, empty"),
    ("ircot null question_id", "hotpot_nq.jsonl", _jsonl(_ircot(question_id=None)),
     r"nq\.jsonl'.*record 0 has a null, empty or non-text id field 'question_id'"),
    ("musique record without id", "mid.jsonl", _jsonl({k: v for k, v in _musique().items() if k != "id"}),
     r"mid\.jsonl'.*record 0 has no id field 'id'"),
    ("iirc list id", "rid.jsonl", _jsonl(_iirc(id=["r1"])), r"rid\.jsonl'.*record 0 has a null, empty"),
]


@pytest.mark.parametrize("label,name,data,match", ID_FAULTS, ids=[r[0] for r in ID_FAULTS])
def test_records_without_an_id_are_refused_not_loaded_as_none(tmp_path, label, name, data, match):
    from sur_lab.data.qa import load_qa

    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        load_qa(path)


def test_integer_ids_are_kept_as_text(tmp_path):
    from sur_lab.data.qa import load_qa

    path = tmp_path / "iid.json"
    path.write_text(json.dumps([_hotpot(_id=7)]))
    assert load_qa(path)[0].id == "7"


def test_a_data_folder_without_sha256sums_is_read_with_one_warning(data_copy):
    from sur_lab.data.qa import UnverifiedDataWarning, load_corpus, load_qa

    (data_copy / "SHA256SUMS").unlink()
    with pytest.warns(UnverifiedDataWarning, match=r"has no SHA256SUMS: its files are read unverified") as caught:
        assert len(load_qa("hotpotqa")) == 100
    assert str(data_copy.resolve()) in str(caught[0].message)
    with warnings.catch_warnings():  # once per folder: the second read is quiet
        warnings.simplefilter("error", UnverifiedDataWarning)
        assert len(load_qa("hotpotqa", limit=3)) == 3
        assert len(load_qa(data_copy / HOTPOT_DEV, limit=2)) == 2
    # A user's own file outside the data folder is not "shipped data": no warning.
    corpus = data_copy.parent / "mine.json"
    corpus.write_text(json.dumps([{"title": "A", "text": "a"}]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnverifiedDataWarning)
        assert len(load_corpus(corpus)) == 1


def test_a_file_of_the_data_folder_read_by_path_without_sha256sums_warns(data_copy):
    from sur_lab.data.qa import UnverifiedDataWarning, load_qa

    (data_copy / "SHA256SUMS").unlink()
    with pytest.warns(UnverifiedDataWarning, match="read unverified"):
        load_qa(data_copy / HOTPOT_DEV, limit=1)


# ---- the CLI and the notebook runner check what they can before loading a model or running a notebook ---------------
@pytest.fixture
def no_model(monkeypatch):
    """Loading a model (or a tokenizer) fails the test: these errors must come first."""
    import sur_lab.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad argument was reported")

    monkeypatch.setattr(sur_lab.models, "load_model", refuse)
    monkeypatch.setattr(sur_lab.models, "embedded_tokenizer", refuse)


def _cli(capsys, *argv):
    from sur_lab.runtime import cli

    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


SWEEP_ARG_FAULTS = [
    # (fault input, extra arguments (OUT replaced by the file, DIR by tmp_path), expected message)
    ("--out names an existing file", ["--out", "OUT"],
     r"--out '.*taken\.txt' is an existing file; a sweep writes a folder"),
    ("--out under an existing file", ["--out", "OUT/sub"],
     r"--out '.*taken\.txt/sub': '.*taken\.txt' on its path is a file"),
    ("unknown --executor", ["--out", "DIR/s", "--executor", "packd"], r"--executor: unknown executor name='packd'"),
    ("bad --dtype", ["--out", "DIR/s", "--dtype", "Float32"], r"--dtype: dtype='Float32' is not a model dtype"),
    ("bad --device", ["--out", "DIR/s", "--device", "gpu"], r"--device: device='gpu' is not a device"),
    ("missing local --model", ["--out", "DIR/s", "--model", "./no/such/model"],
     r"--model: model path './no/such/model'"),
    ("misspelt --model", ["--out", "DIR/s", "--model", "qwen-coder"], r"--model: name='qwen-coder' is not an embedded"),
]


@pytest.mark.parametrize("label,extra,match", SWEEP_ARG_FAULTS, ids=[r[0] for r in SWEEP_ARG_FAULTS])
def test_sweep_arguments_are_checked_before_a_model_loads(tmp_path, capsys, no_model, label, extra, match):
    taken = tmp_path / "taken.txt"
    taken.write_text("mine")
    argv = [a.replace("OUT", str(taken)).replace("DIR", str(tmp_path)) for a in extra]
    code, _, err = _cli(capsys, "sweep", "niah", "--preset", "smoke", "--no-progress", *argv)
    assert code == 2 and re.search(match, err), err
    assert "Traceback" not in err and taken.read_text() == "mine"
    assert not (tmp_path / "s").exists()


def test_sweep_refuses_a_negative_seed_at_parse_time(capsys, no_model):
    code, _, err = _cli(capsys, "sweep", "niah", "--preset", "smoke", "--seed", "-1")
    assert code == 2 and "--seed must be an integer >= 0; got '-1'" in err


RANGE_NOTEBOOK = "value: int = 1  # a count {1..5}\nname: str = 'a'  # a choice {\"a\" | \"b\"}"


def _range_notebook(folder: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell(RANGE_NOTEBOOK)
    params.metadata["tags"] = ["parameters"]
    check = nbformat.v4.new_code_cell("from sur_lab.runtime.params import validate_parameters\n"
                                      "validate_parameters(globals())\nprint('ran with', value, name)")
    nb.cells = [params, check]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nb_range.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("overrides,match", [
    (["-p", "value", "0"], r"'value' must be in \[1, 5\] \(declared \{1..5\}\); got 0"),
    (["-p", "value", "9", "-p", "name", "c"], r"'value' must be in \[1, 5\].*\n.*'name' must be one of 'a', 'b'"),
])
def test_runners_refuse_out_of_range_parameters_before_any_notebook_runs(tmp_path, capsys, monkeypatch, overrides,
                                                                          match):
    import sur_lab.runtime.run_notebooks as runner

    path = _range_notebook(tmp_path / "nbs")
    monkeypatch.setattr(runner, "run_notebook", lambda *a, **k: pytest.fail("a notebook ran"))
    code = runner.main(["--notebooks", str(path.parent), "--outputs", str(tmp_path / "out"), *overrides])
    err = capsys.readouterr().err
    assert code == 2 and re.search(match, err) and "nothing was run" in err
    code, _, err = _cli(capsys, "run", str(path), "--out", str(tmp_path / "out"), *overrides)
    assert code == 2 and re.search(match, err) and "nothing was run" in err
    assert not (tmp_path / "out").exists()


def test_run_notebook_refuses_an_out_of_range_parameter_before_writing(tmp_path):
    from sur_lab.runtime.params import ParameterRangeError
    from sur_lab.runtime.run_notebooks import run_notebook

    path = _range_notebook(tmp_path / "nbs")
    with pytest.raises(ParameterRangeError, match=r"nb_range\.ipynb: parameter 'value' must be in \[1, 5\]"):
        run_notebook(path, {"value": 6}, outputs=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_plain_papermill_run_is_checked_by_the_validation_cell(tmp_path):
    """Without sur_lab's runner, the kernel's validate_parameters(globals()) reads the ranges from the parameters cell
    in IPython's history and fails the run at the validation cell, before the study's cells."""
    import papermill as pm

    path = _range_notebook(tmp_path / "nbs")
    with pytest.raises(pm.PapermillExecutionError, match=r"ParameterRangeError.*'value' must be in \[1, 5\]"):
        pm.execute_notebook(str(path), str(tmp_path / "out.ipynb"), parameters={"value": 7}, progress_bar=False,
                            kernel_name="python3", cwd=str(path.parent))
    out = pm.execute_notebook(str(path), str(tmp_path / "ok.ipynb"), parameters={"value": 3}, progress_bar=False,
                              kernel_name="python3", cwd=str(path.parent))
    assert "ran with 3 a" in "".join(o.get("text", "") for o in out.cells[-1].outputs)


def test_run_refuses_an_out_folder_that_is_a_file_before_any_notebook_runs(tmp_path, capsys, monkeypatch):
    import sur_lab.runtime.run_notebooks as runner

    path = _range_notebook(tmp_path / "nbs")
    taken = tmp_path / "taken.txt"
    taken.write_text("mine")
    monkeypatch.setattr(runner, "run_notebook", lambda *a, **k: pytest.fail("a notebook ran"))
    code, _, err = _cli(capsys, "run", str(path), "--out", str(taken))
    assert code == 2 and "is an existing file; the executed notebooks go into a folder" in err
    assert taken.read_text() == "mine"
# Issue 24 (edit sessions): silent wrong results. The staleness debt tells the truth (rows refreshed over stale
# predecessors stay in the debt, appendix 14), debt_pct=100 gives the clean cache, and a StaticCache's padding is
# never taken (tests/test_bad_inputs.py, the caches-handed-in section).
# =====================================================================================================================
DEBT_FAULTS = [
    # (label, session method, budget, debt_pct of the edit)
    ("SUR 20 % then debt 100 %", "SUR", 20, 100),
    ("SUR 20 % no debt", "SUR", 20, 0),
    ("Shift then debt 50 %", "Shift", 0, 50),
]


@pytest.mark.parametrize("label,method,budget,debt_pct", DEBT_FAULTS, ids=[r[0] for r in DEBT_FAULTS])
def test_staleness_debt_is_true_after_an_edit(lm64, label, method, budget, debt_pct):
    from conftest import fp64_tol
    from sur_lab import EditSession
    from sur_lab.forward import prefill

    g = torch.Generator().manual_seed(11)
    session = EditSession(lm64, method=method, budget_pct=budget)
    session.append(torch.randint(0, 96, (60,), generator=g))
    session.delete(3, 6)  # an earlier edit leaves debt behind the next one
    session.delete(20, 28, debt_pct=debt_pct)
    clean = prefill(lm64, session.tokens)[0]
    fresh = len(session) - session.debt
    assert max(max_abs_diff(session.cache, clean, slice(0, fresh))) <= fp64_tol(clean)
    if debt_pct == 100:
        assert session.debt == 0 and max(max_abs_diff(session.cache, clean)) <= fp64_tol(clean)
    else:
        assert session.debt > 0  # and the first row it counts really differs from the clean prefill
        assert max(max_abs_diff(session.cache, clean, slice(fresh, fresh + 1))) > 1e3 * fp64_tol(clean)
