"""Sweeps on Ray actors: same records as a serial run, exact resume after a driver interrupt or a dead worker, argument
errors before any work, and the concurrency guard of latency tables. Ray tests are marked ``ray``
(deselect with ``-m 'not ray'``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import make_tiny_model
from sur_lab.analysis.stats import CONCURRENCY_FIELDS, check_concurrency
from sur_lab.sweeps import TIMING_FIELDS, run_sweep
from sur_lab.sweeps import ray as distributed
from sur_lab.sweeps.ray import POLL_S, check_workers, model_args_of
from sur_lab.studies.niah import build_niah_case, niah_scorer, parse_niah_answer
from test_allocators import char_tokenizer
from test_niah import CORPUS

METHODS = ("Shift", "Re-prefill", "SUR", "Random semantic units")
BUDGETS = (5, 37)
RECORDS_PER_CASE = 2 + 2 * 2
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny float64 Llama and the character tokenizer, saved with save_pretrained (so actors can load them)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    lm = make_tiny_model("llama")
    lm.model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def args(model_dir):
    return {"name": str(model_dir), "dtype": "float64"}


@pytest.fixture(scope="module")
def cases():
    tok = char_tokenizer()
    out = []
    for i, (depths, delete) in enumerate([((0.2, 0.6), 0), ((0.7, 0.3), 1), ((0.3, 0.8), 0)]):
        case = build_niah_case(tok, CORPUS, context_len=260 + 40 * i, depths=depths, delete=delete, seed=i)
        out.append(dataclasses.replace(case.sweep_case(), case_id=f"case/{i}"))
    return out


@pytest.fixture(scope="module")
def serial(args, cases, tmp_path_factory):
    """The serial run (one process, one torch thread, like each actor)."""
    from sur_lab.models import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lm = load_model(**args)
        return run_sweep(lm, cases, METHODS, BUDGETS, tmp_path_factory.mktemp("serial"), max_new_tokens=4,
                         scorer=niah_scorer, parser=parse_niah_answer, seed=1, progress=False)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    # Actors import this module to unpickle the test scorers; they inherit the driver's environment.
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    distributed.init_ray(num_cpus=2)
    yield ray
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def test_local_workers_run_at_the_drivers_niceness(ray_session):
    """Ray's workers default to niceness 15 above the driver; a sweep's local instance starts them at the driver's
    own (init_ray), so a second job on the machine does not take the sweep's cores."""
    ray = ray_session

    @ray.remote
    def niceness():
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)  # the driver's own (CI may run the suite niced)


def _results(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=[*TIMING_FIELDS, *CONCURRENCY_FIELDS]).reset_index(drop=True)


def _nested(value):
    """Lists for the list-valued fields (Parquet reads them back as arrays)."""
    if isinstance(value, (np.ndarray, list, tuple)):
        return [_nested(v) for v in value]
    return value


def _assert_same_records(got: pd.DataFrame, want: pd.DataFrame, *, batching: bool = False) -> None:
    """Equal record for record: exact for ids, text, supports and flags; floats to fp64 rounding (the actor and the
    driver run the same float64 computation with one thread each, so 1e-12 relative is a loose bound).

    With ``batching``, the two runs answered in batches of different sizes: ``eval_batch``, ``timed`` and
    ``shared_prefix`` (a case answered one record at a time is timed, so it never shares its prefix) are not
    compared, and floats agree to a few float32 ulps (the answers' logits are float32, and a batched float64 forward
    rounds differently from a single one by ~1e-15 before that cast: at most one float32 ulp per logit, summed over
    at most four scored tokens)."""
    a, b = _results(got), _results(want)
    if batching:
        drop = ["eval_batch", "timed", "shared_prefix"]
        a, b = a.drop(columns=drop), b.drop(columns=drop)
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    for col in a.columns:
        if a[col].dtype.kind == "f":
            tol = dict(rtol=1e-5, atol=1e-6) if batching else dict(rtol=1e-12, atol=0)
            np.testing.assert_allclose(a[col].to_numpy(), b[col].to_numpy(), equal_nan=True, err_msg=col, **tol)
        else:
            assert [_nested(v) for v in a[col]] == [_nested(v) for v in b[col]], col


class KillOnce:
    """A scorer that kills its own worker process (SIGKILL-like ``os._exit``) after ``after`` records of ``case_id``,
    once (a marker file remembers), then scores like :func:`niah_scorer`."""

    def __init__(self, marker: str, case_id: str, after: int) -> None:
        self.marker, self.case_id, self.after, self.seen = marker, case_id, after, 0

    def __call__(self, case, text):
        if case.case_id == self.case_id and not os.path.exists(self.marker):
            self.seen += 1
            if self.seen > self.after:
                Path(self.marker).write_text(str(os.getpid()))
                os._exit(9)
        return niah_scorer(case, text)


class SlowScorer:
    """A scorer that waits ``seconds`` before it scores like :func:`niah_scorer`, so that a case is still running
    (with some of its records written) across several of the driver's polls, whatever the CPU's speed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, case, text):
        time.sleep(self.seconds)
        return niah_scorer(case, text)


# --- no Ray needed -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, -1, 1.5, "2", True, None])
def test_bad_workers_refused_before_any_work(workers, args, cases, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        run_sweep(args, cases, METHODS, BUDGETS, out, workers=workers)
    assert not out.exists()


@pytest.mark.parametrize("address", ["nowhere", "ray://", "ray://head", "head:99999", "http://head:10001", 7])
def test_bad_address_refused_before_any_work(address, args, cases, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="address must be"):
        run_sweep(args, cases, METHODS, BUDGETS, out, workers=2, address=address)
    assert not out.exists()


def test_good_addresses_and_threads():
    for address in (None, "auto", "local", "ray://head:10001", "10.0.0.1:6379"):
        check_workers(3, address)
    with pytest.raises(ValueError, match="threads must be"):
        check_workers(2, None, threads=0)
    assert distributed.default_threads(2, 16) == 8 and distributed.default_threads(4, 2) == 1


def test_more_cuda_actors_than_local_gpus_refused_before_any_work(args, cases, tmp_path):
    """Each CUDA actor reserves one GPU: workers > GPUs would leave actors waiting forever, so it is refused first."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"workers=2 with device='cuda'.* this machine has 0; use workers <= 1"):
        run_sweep({**args, "device": "cuda"}, cases, METHODS, BUDGETS, out, workers=2)
    assert not out.exists()
    distributed.check_local_gpus({"device": "cuda:0"}, 2, None, available=2)  # enough GPUs
    distributed.check_local_gpus({"device": "cuda"}, 8, "auto", available=0)  # a cluster: Ray schedules the GPUs
    distributed.check_local_gpus({"device": "cpu"}, 8, None, available=0)
    with pytest.raises(ValueError, match="workers=3"):
        distributed.check_local_gpus({"device": "cuda"}, 3, "local", available=2)


def test_model_args_of_a_loaded_model(args):
    from sur_lab.models import load_model

    lm = load_model(**args)
    assert model_args_of(lm) == {"name": args["name"], "dtype": "float64", "device": "cpu"}
    assert distributed.model_label(args) == lm.spec.name
    assert distributed.model_label({"name": None}) == "SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="'name'"):
        model_args_of({"dtype": "float32"})


def test_missing_ray_says_how_to_install(monkeypatch, args, cases, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[distributed\]'"):
        run_sweep(args, cases, METHODS, BUDGETS, tmp_path, workers=2, max_new_tokens=4)


def test_importing_sur_lab_does_not_import_ray():
    code = ("import sys, sur_lab, sur_lab.sweeps, sur_lab.sweeps.ray, sur_lab.runtime.cli, "
            "sur_lab.runtime.params; assert 'ray' not in sys.modules, 'ray imported'")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)


def test_batched_and_per_record_serial_runs_agree(args, cases, serial, tmp_path):
    """The serial run answers a case's records in one batch (eval_batch 16); answering each record alone gives the
    same records. Answers, ids and supports are exact; floats to a few float32 ulps (the answers' logits are float32,
    and a batched float64 forward rounds differently from a single one by ~1e-15 before that cast)."""
    from sur_lab.models import load_model

    assert set(serial["eval_batch"]) == {16}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = run_sweep(load_model(**args), cases, METHODS, BUDGETS, tmp_path, max_new_tokens=4, scorer=niah_scorer,
                        parser=parse_niah_answer, seed=1, progress=False, eval_batch=1)
    finally:
        torch.set_num_threads(threads)
    assert set(one["eval_batch"]) == {1} and one["timed"].all() and not serial["timed"].any()
    _assert_same_records(one, serial, batching=True)


def test_serial_records_carry_concurrency(serial):
    assert set(serial["workers"]) == {1} and set(serial["threads"]) == {1}


def test_check_concurrency_refuses_mixed_settings():
    same = pd.DataFrame({"workers": [1, 1], "threads": [2, 2], "latency_ms": [1.0, 2.0]})
    check_concurrency(same)
    mixed = pd.DataFrame({"workers": [1, 2], "threads": [2, 1], "latency_ms": [1.0, 2.0]})
    with pytest.raises(ValueError, match="workers=1, threads=2; workers=2, threads=1"):
        check_concurrency(mixed)
    with pytest.warns(UserWarning, match="2 concurrency settings"):
        check_concurrency(mixed, strict=False)
    check_concurrency(pd.DataFrame({"latency_ms": [1.0]}))  # records made before the fields existed


# --- on Ray --------------------------------------------------------------------------------------------------------


@pytest.mark.ray
def test_two_workers_equal_the_serial_run(ray_session, args, cases, serial, tmp_path):
    df = run_sweep(args, cases, METHODS, BUDGETS, tmp_path, workers=2, threads=1, max_new_tokens=4,
                   scorer=niah_scorer, parser=parse_niah_answer, seed=1, progress=False)
    _assert_same_records(df, serial)
    _assert_same_records(pd.read_parquet(tmp_path / "records.parquet"), serial)
    assert set(df["workers"]) == {2} and set(df["threads"]) == {1}
    assert json.loads((tmp_path / "sweep.json").read_text())["workers"] == 2


@pytest.mark.ray
def test_resume_after_the_driver_is_interrupted(ray_session, args, cases, serial, tmp_path, monkeypatch):
    from sur_lab.sweeps.store import SweepStore

    real = SweepStore.count

    def interrupt_once_records_exist(self, case_id):
        n = real(self, case_id)
        if n:
            raise KeyboardInterrupt
        return n

    monkeypatch.setattr(SweepStore, "count", interrupt_once_records_exist)
    # One record per batch, so that a case's records reach its part file one by one while it runs.
    # The slow scorer keeps every case in flight for several polls (POLL_S), so the driver sees written records of a
    # running case on any CPU; with the plain scorer a fast machine finished each case between two polls.
    kwargs = dict(workers=2, threads=1, max_new_tokens=4, scorer=SlowScorer(2 * POLL_S / RECORDS_PER_CASE + 0.1),
                  parser=parse_niah_answer, seed=1, progress=False, eval_batch=1)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(args, cases, METHODS, BUDGETS, tmp_path, **kwargs)
    assert not (tmp_path / "records.parquet").exists()
    before = {}
    for part in (tmp_path / "parts").glob("*.jsonl"):
        for line in part.read_text().splitlines():
            rec = json.loads(line)
            before[(rec["case_id"], rec["method"], str(rec["budget_pct"]))] = rec["latency_ms"]
    assert 0 < len(before) < len(serial)
    monkeypatch.setattr(SweepStore, "count", real)
    df = run_sweep(args, cases, METHODS, BUDGETS, tmp_path, **kwargs)
    _assert_same_records(df, serial, batching=True)
    kept = {(r.case_id, r.method, str(r.budget_pct)): r.latency_ms for r in df.itertuples()}
    # Records finished before the interrupt were not recomputed (their timings are the stored ones).
    assert {k: kept[k] for k in before} == before
    for part in (tmp_path / "parts").glob("*.jsonl"):
        assert len(part.read_text().splitlines()) == RECORDS_PER_CASE  # nothing written twice


@pytest.mark.ray
def test_resume_after_a_worker_dies(ray_session, args, cases, serial, tmp_path):
    marker = tmp_path / "killed"
    victim = cases[1].case_id
    df = run_sweep(args, cases, METHODS, BUDGETS, tmp_path / "out", workers=2, threads=1, max_new_tokens=4,
                   scorer=KillOnce(str(marker), victim, after=2), parser=parse_niah_answer, seed=1, progress=False)
    assert marker.exists(), "the worker was not killed"
    _assert_same_records(df, serial)
    for part in (tmp_path / "out" / "parts").glob("*.jsonl"):
        lines = [json.loads(x) for x in part.read_text().splitlines()]
        assert len(lines) == RECORDS_PER_CASE  # the victim's first two records were kept, not redone


def test_natural_qa_latency_table_refuses_mixed_concurrency():
    from sur_lab.studies.natural_qa import aggregate_trials, quality_latency_table, results_table
    from test_natural_qa import _records

    records = _records()
    one = results_table(records.assign(workers=1, threads=2))
    assert len(quality_latency_table(one)) == 6  # one setting: pooled as before
    mixed = results_table(records.assign(workers=np.where(records["dataset"] == "iirc", 2, 1), threads=1))
    with pytest.raises(ValueError, match="2 concurrency settings"):
        quality_latency_table(mixed)
    with pytest.warns(UserWarning) as caught:
        summary = quality_latency_table(mixed, mixed_concurrency="warn")
    messages = " | ".join(str(w.message) for w in caught)
    assert "2 concurrency settings" in messages and "2 workers sharing the machine" in messages
    assert len(summary) == 6
    with pytest.raises(ValueError, match="mixed_concurrency"):
        quality_latency_table(one, mixed_concurrency="ignore")
    trials = _records(trials=2)
    trials = results_table(trials.assign(workers=1, threads=np.where(trials["trial"] == 0, 1, 2)))
    with pytest.raises(ValueError, match="trial timings"):
        aggregate_trials(trials)
