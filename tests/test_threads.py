"""Several threads repairing and answering on one model (issue 24, kind 1; docs/threads.md).

Every task runs once single-threaded for its reference, then many times from several threads at once on the same tiny
float64 model. Each concurrent result must be bitwise the reference: the same arithmetic on the same shapes, with one
torch thread per call (set here), gives the same bits whatever else runs; before the fix a packed refresh switched the
model's shared ``config._attn_implementation``, so a concurrent prefill or answer raised, and the probes of the
prior-work allocators recorded other threads' forwards. The overlap tests force the harmful interleavings with events
instead of relying on timing.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import make_tiny_model
from sur_lab.answer import answer
from sur_lab.cache_ops import to_tensors
from sur_lab.edits import token_edit
from sur_lab.executors import get_executor
from sur_lab.forward import prefill
from sur_lab.repair import prepare, recover, repair

THREADS = 6
WAIT_S = 60  # generous: a stuck event means a deadlock, not slowness


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread per call, so a result cannot depend on how many threads the op happened to get."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm():
    return make_tiny_model("llama")


def _edit(seed: int, n: int = 48, p: int = 6, d: int = 5, q: int = 4):
    g = torch.Generator().manual_seed(seed)
    return token_edit(torch.randint(0, 96, (n,), generator=g), p, d, torch.randint(0, 96, (q,), generator=g))


def _tensors(cache) -> list[torch.Tensor]:
    return [t.clone() for kv in to_tensors(cache) for t in kv]


def _tasks(lm):
    """(name, fn) pairs; each fn returns a list of tensors (caches as their K/V, answers as ids and logits)."""
    edits = [_edit(seed) for seed in range(3)]
    prepared = [prepare(lm, e) for e in edits]
    tasks = []
    for i, (e, prep) in enumerate(zip(edits, prepared)):
        tasks += [
            (f"packed SUR {i}", lambda prep=prep: _tensors(repair(lm, prep, "SUR", 30, executor="packed").cache)),
            (f"packed-sdpa {i}", lambda prep=prep: _tensors(repair(lm, prep, "SUR", 30, executor="packed-sdpa").cache)),
            (f"sequential SUR {i}",
             lambda prep=prep: _tensors(repair(lm, prep, "SUR", 30, executor="sequential").cache)),
            (f"one-shot {i}", lambda prep=prep: _tensors(repair(lm, prep, "SUR", 30, executor="one-shot").cache)),
            (f"direct-sequential {i}",
             lambda prep=prep: _tensors(repair(lm, prep, "SUR", 30, executor="direct-sequential").cache)),
            (f"A3 probe {i}", lambda prep=prep: _tensors(repair(lm, prep, "A3-Adapted", 30, executor="packed").cache)),
            (f"ProphetKV probe {i}",
             lambda prep=prep: _tensors(repair(lm, prep, "ProphetKV-Adapted", 30, executor="sequential").cache)),
            (f"recover overlap {i}",
             lambda e=e, prep=prep: _tensors(recover(lm, e, prep.dirty_cache, "SUR", 30, overlap=True).cache)),
            (f"prefill {i}", lambda e=e: [prefill(lm, e.edited_ids)[1]]),
            (f"prepare {i}", lambda e=e: _tensors(prepare(lm, e).shift_cache)),
            (f"answer {i}", lambda e=e, prep=prep: _answer(lm, prep.shift_cache, e)),
        ]
    return tasks


def _answer(lm, cache, edit):
    out = answer(lm, cache, edit, max_new_tokens=4)
    return [torch.tensor(out.token_ids, dtype=torch.long), out.first_token_logits]


def _assert_same(name, got, want):
    assert len(got) == len(want), name
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b), f"{name}: differs from its single-threaded result"


def test_concurrent_repairs_prefills_and_answers_equal_the_single_threaded_results(lm):
    tasks = _tasks(lm)
    reference = {name: fn() for name, fn in tasks}
    work = tasks * 3
    random.Random(0).shuffle(work)
    start = threading.Barrier(THREADS)

    def run(item):
        name, fn = item
        return name, fn()

    def first(item):  # the first THREADS calls start together
        start.wait(timeout=WAIT_S)
        return run(item)

    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(first if k < THREADS else run, item) for k, item in enumerate(work)]
        results = [f.result(timeout=10 * WAIT_S) for f in futures]
    assert len(results) == len(work)
    for name, got in results:
        _assert_same(name, got, reference[name])
    # The model still serves ordinary forwards exactly as before.
    _assert_same("prefill after", [prefill(lm, _edit(0).edited_ids)[1]], reference["prefill 0"])


def _paused_attend(monkeypatch, pause):
    """Patch the packed attention so that ``pause(thread_name)`` runs before its first layer in each thread."""
    import sur_lab.executors.packed as packed

    original = packed._PackedAttention.attend
    seen: set[str] = set()

    def attend(self, *args, **kwargs):
        name = threading.current_thread().name
        if name not in seen:
            seen.add(name)
            pause(name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(packed._PackedAttention, "attend", attend)


def test_prefill_and_answer_during_a_packed_refresh_and_overlapping_refreshes_leave_the_model_usable(lm, monkeypatch):
    """Interleaving forced with events: refresh A pauses inside its traversal while thread C prefills and answers and
    refresh B enters its own traversal; A then finishes while B is still inside, then B finishes. Before the fix C
    raised (the shared config named the packed attention) and B restored the packed mode for good."""
    edit = _edit(7)
    prep = prepare(lm, edit)
    run = get_executor("packed")
    support = [1, 2, 5, 9, 20]
    want_cache = _tensors(run(lm, prep.shift_cache, edit, support))
    want_prefill = [prefill(lm, edit.edited_ids)[1]]
    want_answer = _answer(lm, prep.shift_cache, edit)

    b_inside, a_done = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def thread_c():
        try:
            results["C"] = ([prefill(lm, edit.edited_ids)[1]], _answer(lm, prep.shift_cache, edit))
        except Exception as err:  # noqa: BLE001 - reported below
            results["C"] = err

    def thread_b():
        try:
            results["B"] = _tensors(run(lm, prep.shift_cache, edit, support))
        except Exception as err:  # noqa: BLE001
            results["B"] = err

    def pause(name):
        if name == "A":
            c = threading.Thread(target=thread_c, name="C")
            c.start()
            c.join(WAIT_S)
            threading.Thread(target=thread_b, name="B", daemon=True).start()
            assert b_inside.wait(WAIT_S), "B never entered its traversal"
        elif name == "B":
            b_inside.set()
            assert a_done.wait(WAIT_S), "A never finished"

    _paused_attend(monkeypatch, pause)

    def thread_a():
        try:
            results["A"] = _tensors(run(lm, prep.shift_cache, edit, support))
        finally:
            a_done.set()

    a = threading.Thread(target=thread_a, name="A")
    a.start()
    a.join(WAIT_S)
    for _ in range(int(WAIT_S * 10)):
        if "B" in results:
            break
        threading.Event().wait(0.1)
    for key in "ABC":
        assert not isinstance(results.get(key), Exception), f"thread {key} raised {results.get(key)!r}"
    _assert_same("A", results["A"], want_cache)
    _assert_same("B", results["B"], want_cache)
    _assert_same("C prefill", results["C"][0], want_prefill)
    _assert_same("C answer", results["C"][1], want_answer)
    # After both refreshes the model serves ordinary forwards exactly as before.
    _assert_same("prefill after", [prefill(lm, edit.edited_ids)[1]], want_prefill)
    _assert_same("answer after", _answer(lm, prep.shift_cache, edit), want_answer)


def test_a_probe_in_one_thread_neither_stops_nor_records_another_threads_forward(lm, monkeypatch):
    """A3-Adapted's shallow forward stops the model after a few layers with a hook on a shared layer, and its probe
    records attention rows from a hook: while it is paused inside its forward, another thread's full prefill must run
    all layers, unrecorded."""
    from sur_lab.allocators import signals

    edit = _edit(8)
    prep = prepare(lm, edit)
    want_sel = repair(lm, prep, "A3-Adapted", 30, executor="packed").selection.support.positions.copy()
    want_prefill = prefill(lm, edit.edited_ids)[1]
    inside, done = threading.Event(), threading.Event()
    original = signals.row_attention
    calls = {"other": 0}

    def row_attention(*args, **kwargs):
        if threading.current_thread().name == "prober" and not inside.is_set():
            inside.set()
            assert done.wait(WAIT_S), "the other thread never finished"
        elif threading.current_thread().name != "prober":
            calls["other"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(signals, "row_attention", row_attention)
    out: dict[str, object] = {}

    def prober():
        out["sel"] = repair(lm, prep, "A3-Adapted", 30, executor="packed").selection.support.positions.copy()

    t = threading.Thread(target=prober, name="prober")
    t.start()
    assert inside.wait(WAIT_S)
    try:
        out["prefill"] = prefill(lm, edit.edited_ids)[1]
    finally:
        done.set()
        t.join(WAIT_S)
    assert torch.equal(out["prefill"], want_prefill)
    assert calls["other"] == 0
    assert (out["sel"] == want_sel).all()


def test_sentence_segmentation_is_thread_safe():
    """pysbd's Segmenter keeps the text it segments on the instance: one shared by threads located one thread's
    sentences in another's text and dropped them. Units are built on the preparation worker and caller threads."""
    from sur_lab.units import text_segments

    rng = random.Random(0)
    words = "alpha beta gamma delta river bank quiet magic number wide late end".split()
    texts = []
    for k in range(40):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + "." for _ in
                     range(rng.randint(3, 12))]
        texts.append(f"Doc {k}. " + " ".join(sentences) + "\n" + " ".join(reversed(sentences)))
    want = [text_segments(t) for t in texts]
    with ThreadPoolExecutor(THREADS) as pool:
        for _ in range(3):
            assert list(pool.map(text_segments, texts)) == want
