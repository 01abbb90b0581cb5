"""Bad inputs are refused, not reinterpreted (issue 12, kinds 5, 6 and 8a/8b): one row per input, with the expected
error (type and a substring naming the argument) or value.

Rows cover token-level edits, composed prompts, supports, the forward entry points, the sequential executor, greedy
decoding, model loading, context length, reference methods and the whole-context deletion. ``chat_edit`` inputs and
the notebook runner's ``-p`` are tested with their owners' modules.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from sur_lab.answer import answer, greedy_answer
from sur_lab.budget import Support
from sur_lab.cache_ops import from_tensors, to_tensors
from sur_lab.edits import EditedContext, token_edit
from sur_lab.executors import refresh_sequential, replay, shift
from sur_lab.forward import prefill
from sur_lab.models import _check_dtype, embedded_names, load_model
from sur_lab.repair import REFERENCE_METHODS, prepare, repair
from sur_lab.studies.noprefix import compose_tokens
from sur_lab.studies.theory import traversals

REPO = Path(__file__).resolve().parent.parent
VOCAB = 96
IDS = list(range(20))
Q = [1, 2, 3]


@pytest.fixture(scope="module")
def lm():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def prepared(lm):
    return prepare(lm, token_edit(IDS, 4, 3, Q))


def _batch2(cache):
    return from_tensors([(torch.cat((k, k)), torch.cat((v, v))) for k, v in to_tensors(cache)])


# ---- kind 5: token-level edits (token_edit / EditedContext) ----------------------------------------------------------
EDIT_ROWS = [
    # (id, kwargs overriding a valid edit, error type, substring naming the argument)
    ("batch-2 original_ids", dict(original_ids=torch.tensor([IDS, IDS])), ValueError, "original_ids"),
    ("batch-2 query_ids", dict(query_ids=torch.tensor([Q, Q])), ValueError, "query_ids"),
    ("3-D original_ids", dict(original_ids=torch.tensor([[IDS]] * 2)), ValueError, "original_ids"),
    ("float original_ids", dict(original_ids=[float(i) + 0.5 for i in IDS]), TypeError, "original_ids"),
    ("float tensor query_ids", dict(query_ids=torch.tensor([1.0, 2.0])), TypeError, "query_ids"),
    ("bool original_ids", dict(original_ids=[True] * 20), TypeError, "original_ids"),
    ("float question_ids", dict(question_ids=[1.5]), TypeError, "question_ids"),
    ("negative token id", dict(original_ids=[-1] + IDS[1:]), ValueError, "original_ids"),
    ("string ids", dict(original_ids="hello"), TypeError, "original_ids"),
    ("float prefix_len", dict(prefix_len=3.7), TypeError, "prefix_len"),
    ("integral float prefix_len", dict(prefix_len=4.0), TypeError, "prefix_len"),
    ("float deleted_len", dict(deleted_len=2.5), TypeError, "deleted_len"),
    ("bool deleted_len", dict(deleted_len=True), TypeError, "deleted_len"),
    ("None prefix_len", dict(prefix_len=None), TypeError, "prefix_len"),
    ("negative prefix_len", dict(prefix_len=-1), ValueError, "prefix_len"),
    ("empty span", dict(deleted_len=0), ValueError, "deleted_len"),
    ("span past the end", dict(prefix_len=18, deleted_len=3), ValueError, "prefix_len"),
    ("empty query", dict(query_ids=[]), ValueError, "query_ids"),
    # kind 6: a whole-context deletion is refused at edit time, for every method alike.
    ("whole-context deletion p=0 d=N", dict(prefix_len=0, deleted_len=20), ValueError, "whole context"),
]


@pytest.mark.parametrize("row", EDIT_ROWS, ids=[r[0] for r in EDIT_ROWS])
def test_token_edit_refuses(row):
    _, override, error, match = row
    kwargs = dict(original_ids=IDS, prefix_len=4, deleted_len=3, query_ids=Q) | override
    with pytest.raises(error, match=match):
        token_edit(**kwargs)
    with pytest.raises(error, match=match):  # the dataclass itself checks the same fields
        EditedContext(**kwargs)


@pytest.mark.parametrize(
    "ids,expected",
    [(torch.tensor([IDS]), IDS), (np.array(IDS, dtype=np.int32), IDS), (torch.tensor(IDS, dtype=torch.int16), IDS)],
    ids=["[1, N] is batch size one", "int32 numpy", "int16 tensor"],
)
def test_token_edit_accepts_integer_ids_of_batch_size_one(ids, expected):
    edit = token_edit(ids, np.int64(4), 3, Q)
    assert edit.original_ids.tolist() == expected and edit.original_ids.dtype == torch.long
    assert (edit.prefix_len, edit.deleted_len) == (4, 3) and type(edit.prefix_len) is int


def test_deleting_all_but_one_token_is_accepted_by_every_method(lm):
    # The edge next to the refused whole-context deletion: p = 0, S = 1. Every method returns one row.
    edit = token_edit(IDS, 0, 19, Q)
    prep = prepare(lm, edit)
    for method in (*REFERENCE_METHODS, "SUR"):
        result = repair(lm, prep, method, 100)
        assert result.cache.get_seq_length() == (20 if method == "Dirty" else 1), method


# ---- kind 5: composed prompts (compose_tokens) -----------------------------------------------------------------------
COMPOSE_ROWS = [
    ("batch-2 prefix_ids", dict(prefix_ids=torch.tensor([[1, 2], [3, 4]])), ValueError, "prefix_ids"),
    ("batch-2 document", dict(documents=[torch.tensor([[5, 6], [7, 8]])]), ValueError, r"doc_ids\[0\]"),
    ("batch-2 query_ids", dict(query_ids=torch.tensor([[1, 2], [3, 4]])), ValueError, "query_ids"),
    ("float prefix_ids", dict(prefix_ids=[1.5, 2.0]), TypeError, "prefix_ids"),
    ("float document", dict(documents=[[5, 6], [7.9]]), TypeError, r"doc_ids\[1\]"),
    ("float question_ids", dict(question_ids=[0.5]), TypeError, "question_ids"),
    ("scalar document", dict(documents=[5, 6]), ValueError, r"doc_ids\[0\]"),
    ("no documents", dict(documents=[]), ValueError, "documents"),
]


@pytest.mark.parametrize("row", COMPOSE_ROWS, ids=[r[0] for r in COMPOSE_ROWS])
def test_compose_tokens_refuses(row):
    _, override, error, match = row
    kwargs = dict(prefix_ids=[1, 2], documents=[[5, 6], [7]], query_ids=[3]) | override
    with pytest.raises(error, match=match):
        compose_tokens(**kwargs)


def test_compose_tokens_keeps_a_batch_one_prompt():
    prompt = compose_tokens(torch.tensor([[1, 2]]), [[5, 6], [7]], [3])
    assert prompt.prefix_ids.tolist() == [1, 2] and [d.tolist() for d in prompt.doc_ids] == [[5, 6], [7]]


# ---- kind 5: supports ------------------------------------------------------------------------------------------------
SUPPORT_ROWS = [
    ("float positions", lambda: Support(np.array([0.0, 1.7]), 10), TypeError, "positions"),
    ("float positions (from_unsorted)", lambda: Support.from_unsorted([2.5, 1.0], 10), TypeError, "positions"),
    ("2-D positions", lambda: Support(np.array([[0, 1]]), 10), ValueError, "positions"),
    ("float suffix_len", lambda: Support(np.array([0, 1]), 10.0), TypeError, "suffix_len"),
    ("bool suffix_len", lambda: Support(np.array([0]), True), TypeError, "suffix_len"),
]


@pytest.mark.parametrize("row", SUPPORT_ROWS, ids=[r[0] for r in SUPPORT_ROWS])
def test_support_refuses(row):
    _, build, error, match = row
    with pytest.raises(error, match=match):
        build()


def test_empty_support_from_an_empty_list_is_fine():
    assert Support.from_unsorted([], 5).size == 0 and Support(np.zeros(0), 5).positions.dtype == np.int64


# ---- kind 5: forward entry points (vocabulary known) ----------------------------------------------------------------
@pytest.mark.parametrize(
    "override,name",
    [(dict(original_ids=[VOCAB] + IDS[1:]), "original_ids"), (dict(query_ids=[1, 500]), "query_ids"),
     (dict(question_ids=[VOCAB + 1]), "question_ids")],
)
def test_token_ids_outside_the_vocabulary_are_refused_before_prefill(lm, override, name):
    edit = token_edit(**(dict(original_ids=IDS, prefix_len=4, deleted_len=3, query_ids=Q) | override))
    forwarded = []
    handle = lm.model.model.embed_tokens.register_forward_hook(lambda *_: forwarded.append(1))
    try:
        with pytest.raises(ValueError, match=rf"{name} holds token id \d+ outside the vocabulary \[0, 96\)"):
            prepare(lm, edit)
    finally:
        handle.remove()
    assert forwarded == []  # refused before any forward


def test_prefill_refuses_ids_outside_the_vocabulary(lm):
    with pytest.raises(ValueError, match=r"ids holds token id 96 outside the vocabulary \[0, 96\)"):
        prefill(lm, torch.tensor([1, VOCAB]))


def test_query_ids_outside_the_vocabulary_are_refused_before_decoding(lm, prepared):
    edit = token_edit(IDS, 4, 3, [1, 10_000])
    with pytest.raises(ValueError, match="10000 outside the vocabulary"):
        answer(lm, prepared.shift_cache, edit, max_new_tokens=1)


@pytest.mark.parametrize(
    "ids,error,match",
    [(torch.tensor([1.0, 2.0]), TypeError, "ids must be integer"), (torch.tensor([[1, 2], [3, 4]]), ValueError, "1-D"),
     (torch.tensor([], dtype=torch.long), ValueError, "non-empty")],
    ids=["float ids", "batch-2 ids", "empty ids"],
)
def test_prefill_refuses(lm, ids, error, match):
    with pytest.raises(error, match=match):
        prefill(lm, ids)


# ---- kind 5: executors and reference operators with a batch-2 cache ------------------------------------------------
def test_sequential_executor_names_a_batch_two_cache(lm, prepared):
    edit = prepared.edit
    with pytest.raises(ValueError, match="cache holds a batch of 2 sequences"):
        refresh_sequential(lm, _batch2(prepared.shift_cache), edit, Support(np.array([0, 3]), edit.suffix_len))


@pytest.mark.parametrize("name", ["packed-sdpa", "direct-sequential", "one-shot"])
def test_packed_executors_name_a_batch_two_cache(lm, prepared, name):
    from sur_lab.executors import get_executor

    edit = prepared.edit
    with pytest.raises(ValueError, match="batch of 2"):
        get_executor(name)(lm, _batch2(prepared.shift_cache), edit, Support(np.array([0, 3]), edit.suffix_len))


def test_shift_and_replay_name_a_batch_two_cache(lm, prepared):
    with pytest.raises(ValueError, match="dirty_cache holds a batch of 2"):
        shift(lm, _batch2(prepared.dirty_cache), prepared.edit)
    with pytest.raises(ValueError, match="cache holds a batch of 2"):
        replay(lm, _batch2(prepared.dirty_cache), prepared.edit)


def test_answer_names_a_batch_two_cache(lm, prepared):
    with pytest.raises(ValueError, match="cache holds a batch of 2"):
        answer(lm, _batch2(prepared.shift_cache), prepared.edit, max_new_tokens=1)


# ---- kind 5: max_new_tokens ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,error",
    [(True, TypeError), (False, TypeError), (None, TypeError), (2.0, TypeError), (1.5, TypeError), ("3", TypeError),
     (0, ValueError), (-1, ValueError)],
)
def test_max_new_tokens_refuses(lm, prepared, value, error):
    with pytest.raises(error, match="max_new_tokens"):
        answer(lm, prepared.shift_cache, prepared.edit, max_new_tokens=value)
    with pytest.raises(error, match="max_new_tokens"):
        greedy_answer(lm, prepared.shift_cache, prepared.edit.query_ids, max_new_tokens=value)


def test_draft_and_continuation_refuse_float_ids(lm, prepared):
    from sur_lab.answer import continuation_nll

    with pytest.raises(TypeError, match="draft"):
        greedy_answer(lm, prepared.shift_cache, prepared.edit.query_ids, max_new_tokens=2, draft=[1.5, 2.0])
    with pytest.raises(TypeError, match="continuation"):
        continuation_nll(lm, prepared.shift_cache, prepared.edit, [1.0, 2.7])
    with pytest.raises(ValueError, match="continuation"):
        continuation_nll(lm, prepared.shift_cache, prepared.edit, [])


@pytest.mark.parametrize("S", [True, 3.5, -1])
def test_allowance_refuses_a_non_count_suffix_len(S):
    from sur_lab.budget import allowance

    with pytest.raises(ValueError, match="suffix_len"):
        allowance(S, 5)


def test_max_new_tokens_accepts_numpy_integers(lm, prepared):
    out = answer(lm, prepared.shift_cache, prepared.edit, max_new_tokens=np.int64(2))
    assert 1 <= len(out.token_ids) + out.finished <= 2


# ---- kind 5: load_model arguments (checked before anything is loaded) -----------------------------------------------
@pytest.mark.parametrize("dtype", ["bogus", "Float32", "cuda", "int8", "", torch.int64, torch.bool, 32, None])
def test_load_model_refuses_a_bad_dtype(dtype):
    with pytest.raises(ValueError, match=r"dtype=.*allowed: 'float32', 'fp32', 'bfloat16'"):
        load_model("embedded", dtype=dtype)


def test_load_model_suggests_the_lowercase_dtype():
    with pytest.raises(ValueError, match="did you mean 'float32'"):
        load_model("embedded", dtype="Float32")


@pytest.mark.parametrize(
    "dtype,expected",
    [("fp16", torch.float16), ("float16", torch.float16), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
     ("fp32", torch.float32), ("float64", torch.float64), (torch.bfloat16, torch.bfloat16)],
)
def test_load_model_accepts_documented_dtype_names(dtype, expected):
    assert _check_dtype(dtype) is expected


@pytest.mark.parametrize("device", ["gpu", "cuda:banana", 3.5])
def test_load_model_refuses_a_bad_device(device):
    with pytest.raises(ValueError, match="device="):
        load_model("embedded", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of an absent GPU")
def test_load_model_refuses_an_absent_gpu():
    with pytest.raises(ValueError, match=r"device='cuda' is not available"):
        load_model("embedded", device="cuda")


@pytest.mark.parametrize("path", ["./no-such-model", "../no/such/model", "~/no-such-model-dir", "/tmp/no/such/model"])
def test_load_model_names_a_missing_local_path(path):
    with pytest.raises(FileNotFoundError, match=f"model path '{path}' does not exist"):
        load_model(path)


@pytest.mark.parametrize("name", [3, ["a"], b"model"])
def test_load_model_refuses_a_name_that_is_not_a_string_or_path(name):
    with pytest.raises(ValueError, match="name="):
        load_model(name)


@pytest.mark.parametrize("name", ["qwen-0.5b", "smollm", "Qwen2.5-0.5B-Instruct"])
def test_load_model_refuses_an_unknown_name_without_an_owner_at_once(name, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub must not be asked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    with pytest.raises(ValueError, match=f"name='{name}' is not an embedded model") as err:
        load_model(name)
    for alias in ("'SmolLM2-135M-Instruct'", "'embedded'", "'qwen2.5-coder-0.5b'", "'Qwen2.5-Coder-0.5B-Instruct'"):
        assert alias in str(err.value)
    assert "not an existing local directory" in str(err.value) and "'owner/name'" in str(err.value)
    assert embedded_names() == ["SmolLM2-135M-Instruct", "embedded", "huggingfacetb/smollm2-135m-instruct",
                                "smollm2-135m", "Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b"]


def test_load_model_wraps_a_hub_failure_with_the_embedded_names(monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(OSError, match=r"name='Qwen/qwen-0\.5b' could not be loaded \(not an existing local path; "
                                      r"as a hub id: We couldn't connect.*'qwen2\.5-coder-0\.5b'"):
        load_model("Qwen/qwen-0.5b")


def test_load_model_names_a_missing_pathlike(tmp_path):
    missing = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match="absent"):
        load_model(missing)


# ---- kind 5: contexts beyond max_position_embeddings ----------------------------------------------------------------
def test_context_beyond_max_position_embeddings_warns_at_prepare():
    lm = make_tiny_model("llama")
    lm.model.config.max_position_embeddings = 16
    with pytest.warns(UserWarning, match="context of 20 tokens exceeds the model's max_position_embeddings=16"):
        prepare(lm, token_edit(IDS, 4, 3, Q))


def test_context_within_max_position_embeddings_does_not_warn(lm):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare(lm, token_edit(IDS, 4, 3, Q))


# ---- kind 5: reference methods refuse an unknown executor -----------------------------------------------------------
@pytest.mark.parametrize("method", [*REFERENCE_METHODS, "SUR"])
def test_every_method_refuses_an_unknown_executor(lm, prepared, method):
    with pytest.raises(ValueError, match="unknown executor name='bogus'"):
        repair(lm, prepared, method, 10, executor="bogus")


# ---- kind 8a: traversals ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "executor,R,expected",
    [("sequential", 5, 5), ("direct-sequential", 5, 5), ("direct-sequential", 1, 1), ("packed", 5, 1),
     ("packed-sdpa", 7, 1), ("one-shot", 5, 1), ("sequential", 0, 0)],
)
def test_traversals(executor, R, expected):
    assert traversals(executor, R) == expected


@pytest.mark.parametrize("executor,R,match", [("bogus", 3, "executor"), ("sequential", 2.5, "num_intervals"),
                                              ("sequential", -1, "num_intervals"), ("packed", True, "num_intervals")])
def test_traversals_refuses(executor, R, match):
    with pytest.raises(ValueError, match=match):
        traversals(executor, R)


@pytest.mark.parametrize("executor", ["sequential", "direct-sequential", "packed-sdpa", "one-shot"])
def test_traversals_counts_what_the_executor_runs(lm, prepared, executor):
    # Counted independently of the formula: layer 0's input norm runs once per traversal of the model.
    from sur_lab.executors import get_executor

    calls = []
    handle = lm.model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        support = Support(np.array([0, 1, 4, 6, 7, 9]), prepared.edit.suffix_len)  # R = 4
        get_executor(executor)(lm, prepared.shift_cache, prepared.edit, support)
    finally:
        handle.remove()
    assert support.num_intervals == 4
    assert len(calls) == traversals(executor, 4)


# ---- kind 8b: repair gives Cache-Craft-Adapted the Dirty cache ----------------------------------------------------
def test_repair_does_not_rerun_the_deleted_span_for_cache_craft():
    lm = make_tiny_model("qwen3")
    edit = token_edit(torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3)), 10, 8, Q)
    prep = prepare(lm, edit)
    forwarded = []
    handle = lm.model.model.embed_tokens.register_forward_hook(lambda m, args, out: forwarded.append(args[0].numel()))
    try:
        result = repair(lm, prep, "Cache-Craft-Adapted", 10)
    finally:
        handle.remove()
    S, B = edit.suffix_len, result.allowance
    assert result.selection.extra_forward_tokens == S  # not S + d
    # Independently counted: the signal forwards the dirty suffix (S tokens), the sequential refresh the B selected
    # tokens; the deleted span (d = 8) is never forwarded again.
    assert sum(forwarded) == S + B


# =====================================================================================================================
# Issue 24 (robust): positions past the trained range, on every growth path; one warning per public call.
# =====================================================================================================================
LIMIT = 32  # max_position_embeddings of the model below


@pytest.fixture(scope="module")
def short_lm():
    lm = make_tiny_model("llama", seed=3)
    lm.model.config.max_position_embeddings = LIMIT
    return lm


def _context_warnings(fn):
    """Run ``fn`` recording warnings; return the ContextLengthWarning messages and ``fn``'s result."""
    from sur_lab.forward import ContextLengthWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return [str(w.message) for w in caught if issubclass(w.category, ContextLengthWarning)], result


def _ids(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _long_edit(n=LIMIT + 8, p=4, d=3):
    return token_edit(_ids(n), p, d, [1, 2, 3])


def _prepared_long(lm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare(lm, _long_edit())


def _session(lm, n):
    from sur_lab.session import EditSession

    session = EditSession(lm, budget_pct=50)
    session.append(_ids(n, 1))
    return session


# (label, fn(lm) -> None, expected context length in the one warning)
GROWTH_ROWS = [
    ("prefill", lambda lm: prefill(lm, _ids(LIMIT + 1)), LIMIT + 1),
    ("forward_tokens", lambda lm: __import__("sur_lab.forward", fromlist=["x"]).forward_tokens(
        lm, _ids(5), prefill(lm, _ids(LIMIT - 2))[0]), LIMIT + 3),
    ("decode_step", lambda lm: __import__("sur_lab.forward", fromlist=["x"]).decode_step(
        lm, 7, prefill(lm, _ids(LIMIT))[0]), LIMIT + 1),
    # the query ends at LIMIT: only decoding passes it, one warning for the whole answer
    ("answer decoding", lambda lm: greedy_answer(lm, prefill(lm, _ids(LIMIT - 3))[0], torch.tensor([1, 2, 3]),
                                                 max_new_tokens=6), LIMIT + 1),
    ("EditSession.append", lambda lm: _session(lm, LIMIT - 2).append(_ids(6, 2)), LIMIT + 4),
    ("EditSession.replace (longer content)", lambda lm: _session(lm, LIMIT - 1).replace(3, 5, _ids(6, 3)), LIMIT + 3),
    ("EditSession.answer", lambda lm: _session(lm, LIMIT - 1).answer(_ids(4, 4), max_new_tokens=3), LIMIT + 3),
    ("prepare (Dirty prefill)", lambda lm: prepare(lm, _long_edit()), LIMIT + 8),
    ("repair sequential, 2 intervals", lambda lm: repair(lm, _prepared_long(lm), "Replay", None), LIMIT + 5),
]


@pytest.mark.parametrize("row", GROWTH_ROWS, ids=[r[0] for r in GROWTH_ROWS])
def test_every_growth_path_warns_once_past_max_position_embeddings(short_lm, row):
    _, fn, length = row
    messages, _ = _context_warnings(lambda: fn(short_lm))
    assert messages == [f"context of {length} tokens exceeds the model's max_position_embeddings={LIMIT}; positions "
                        "beyond it were not trained and results may be meaningless"]


EXECUTOR_NAMES = ["sequential", "packed", "packed-sdpa", "direct-sequential", "one-shot", "packed-inplace"]


@pytest.mark.parametrize("name", EXECUTOR_NAMES)
def test_executor_traversals_warn_once_when_they_compute_past_the_limit(short_lm, name):
    from sur_lab.cache_ops import clone_cache
    from sur_lab.executors import get_executor

    prepared = _prepared_long(short_lm)
    p, S = prepared.edit.prefix_len, prepared.edit.suffix_len  # p + S = LIMIT + 5
    run = get_executor(name)
    # Four intervals, the last two past the limit: one warning for the call (the interval-wise executors name the
    # first interval that passes it, the packed ones their one traversal's last row).
    past = Support(np.array([0, 1, 5, 6, S - 3, S - 1]), S)
    messages, _ = _context_warnings(lambda: run(short_lm, clone_cache(prepared.shift_cache), prepared.edit, past))
    assert len(messages) == 1
    length = int(re.match(r"context of (\d+) tokens exceeds the model's max_position_embeddings=32", messages[0])[1])
    assert length in (p + S - 2, p + S)
    # Rows all below the limit: the traversal computes nothing past it, no warning.
    within = Support(np.array([0, 1, 5]), S)
    messages, _ = _context_warnings(lambda: run(short_lm, clone_cache(prepared.shift_cache), prepared.edit, within))
    assert messages == []


def test_no_context_warning_within_the_limit_on_any_path(short_lm):
    edit = token_edit(_ids(LIMIT - 6), 4, 3, [1, 2, 3])
    messages, _ = _context_warnings(lambda: [
        answer(short_lm, repair(short_lm, prepare(short_lm, edit), "SUR", 50, executor=name).cache, edit,
               max_new_tokens=3)
        for name in EXECUTOR_NAMES if not name.endswith("inplace")
    ])
    assert messages == []


def test_context_warnings_of_two_threads_do_not_share_one_scope(short_lm):
    """The once-per-call scope is per thread: three threads' calls, each inside a one-warning scope of its own, warn
    three times. (Recorded in the main thread: ``warnings.catch_warnings`` itself is process-global.)"""
    import threading

    from sur_lab.forward import one_context_warning

    started = threading.Barrier(3)

    @one_context_warning
    def call():
        started.wait(timeout=60)  # all three scopes are open at once
        prefill(short_lm, _ids(LIMIT + 2))
        prefill(short_lm, _ids(LIMIT + 3))  # same call: no second warning

    def run():
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    messages, _ = _context_warnings(run)
    assert len(messages) == 3 and all(f"context of {LIMIT + 2} tokens" in m for m in messages)


def test_context_warning_names_the_callers_line(short_lm):
    """The warning points at the user's call, not at sur_lab's internals (or torch's decorator wrappers)."""
    from sur_lab.forward import ContextLengthWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        greedy_answer(short_lm, prefill(short_lm, _ids(LIMIT - 1))[0], torch.tensor([1, 2]), max_new_tokens=3)
    hits = [w for w in caught if issubclass(w.category, ContextLengthWarning)]
    assert len(hits) == 1 and hits[0].filename == __file__


# =====================================================================================================================
# Issue 24 (robust): arguments accepted by type but not by range, at the public boundaries and notebook parameters.
# Each refused before any work, with the argument and the allowed range in the message.
# =====================================================================================================================
def _hotpot_file(tmp_path, n=3):
    import json

    path = tmp_path / "mine_hotpot.json"
    path.write_text(json.dumps([
        {"_id": f"h{i}", "question": f"Who {i}?", "answer": "Ann", "supporting_facts": [["A", 0]],
         "context": [["A", ["Ann did it."]], ["B", ["Bob did not."]]]} for i in range(n)]))
    return path


LOAD_QA_ROWS = [
    # (label, kwargs over a valid call, error type, message pattern: the argument and its allowed range)
    ("non-integer limit", dict(limit=2.5), TypeError, r"limit must be an integer >= 0; got 2.5"),
    ("integral float limit", dict(limit=2.0), TypeError, r"limit must be an integer >= 0; got 2.0"),
    ("boolean limit", dict(limit=True), TypeError, r"limit must be an integer >= 0; got True"),
    ("string limit", dict(limit="2"), TypeError, r"limit must be an integer >= 0"),
    ("negative limit", dict(limit=-1), ValueError, r"limit must be an integer >= 0; got -1"),
    ("integer source", dict(source=5), TypeError, r"source must be a file path .* got int 5"),
    ("None source", dict(source=None), TypeError, r"source must be a file path"),
    ("bytes source", dict(source=b"hotpotqa"), TypeError, r"source must be a file path"),
    ("empty source", dict(source=""), ValueError, r"source='' is empty"),
    ("unknown split", dict(split="validation"), ValueError, r"split='validation' must be one of dev, test, train"),
    ("non-string split", dict(split=1), ValueError, r"split=1 must be one of dev, test, train"),
    ("unknown dataset", dict(dataset="hotpot"), ValueError, r"dataset='hotpot' is not one of"),
]


@pytest.mark.parametrize("row", LOAD_QA_ROWS, ids=[r[0] for r in LOAD_QA_ROWS])
def test_load_qa_refuses(tmp_path, row):
    from sur_lab.data.qa import load_qa

    _, override, error, match = row
    kwargs = dict(source=_hotpot_file(tmp_path), limit=2) | override
    with pytest.raises(error, match=match):
        load_qa(kwargs.pop("source"), **kwargs)


def test_load_qa_takes_integer_limits_of_any_integer_type(tmp_path):
    from sur_lab.data.qa import load_qa

    path = _hotpot_file(tmp_path, 5)
    assert [len(load_qa(path, limit=k)) for k in (0, 2, np.int64(3), 9)] == [0, 2, 3, 5]
    assert len(load_qa(str(path))) == 5


LOAD_CORPUS_ROWS = [
    ("non-integer limit", dict(limit=1.5), TypeError, r"limit must be an integer >= 0"),
    ("negative limit (used to drop the last paragraph)", dict(limit=-1), ValueError, r"limit must be an integer >= 0"),
    ("integer source", dict(source=3), TypeError, r"source must be a file path"),
]


@pytest.mark.parametrize("row", LOAD_CORPUS_ROWS, ids=[r[0] for r in LOAD_CORPUS_ROWS])
def test_load_corpus_refuses(tmp_path, row):
    import json

    from sur_lab.data.qa import load_corpus

    path = tmp_path / "corpus.json"
    path.write_text(json.dumps([{"title": "A", "text": "a"}, {"title": "B", "text": "b"}]))
    _, override, error, match = row
    kwargs = dict(source=path) | override
    with pytest.raises(error, match=match):
        load_corpus(**kwargs)
    assert len(load_corpus(path, limit=1)) == 1 and len(load_corpus(path)) == 2


SELECT_ROWS = [
    ("non-integer n", dict(n=1.5), TypeError, r"n must be an integer >= 0; got 1.5"),
    ("negative n", dict(n=-1), ValueError, r"n must be an integer >= 0; got -1"),
    ("n past the pool", dict(n=4), ValueError, r"n=4 must lie in \[0, len\(examples\)=3\]"),
    ("negative seed", dict(seed=-1), ValueError, r"seed must be an integer >= 0; got -1"),
    ("float seed", dict(seed=0.5), TypeError, r"seed must be an integer >= 0"),
    ("records that are not examples", dict(examples=[{"id": 1}]), TypeError, r"examples must be QAExample records"),
]


@pytest.mark.parametrize("row", SELECT_ROWS, ids=[r[0] for r in SELECT_ROWS])
def test_select_sources_refuses(tmp_path, row):
    from sur_lab.data.qa import load_qa, select_sources

    _, override, error, match = row
    kwargs = dict(examples=load_qa(_hotpot_file(tmp_path)), n=2, seed=0) | override
    with pytest.raises(error, match=match):
        select_sources(**kwargs)


EXAMPLE_INDEX_ROWS = [
    ("negative index (used to be the last example)", -1, ValueError, r"example_index must be an integer >= 0; got -1"),
    ("index past the last example", 3, ValueError, r"example_index=3 must lie in \[0, 3\).*holds 3 examples"),
    ("float index", 1.0, TypeError, r"example_index must be an integer >= 0"),
]


@pytest.mark.parametrize("row", EXAMPLE_INDEX_ROWS, ids=[r[0] for r in EXAMPLE_INDEX_ROWS])
def test_load_example_refuses(tmp_path, row):
    from sur_lab.data.qa import load_example

    _, index, error, match = row
    path = _hotpot_file(tmp_path)
    with pytest.raises(error, match=match):
        load_example(path, index)
    assert load_example(path, 2).id == "h2"


THEORY_EDIT_ROWS = [
    # theory_edit's counts are checked before any file is read (the tokenizer is never reached)
    ("negative example_index", dict(example_index=-1), ValueError, "example_index must be an integer >= 0"),
    ("one passage", dict(num_passages=1), ValueError, "num_passages must be an integer >= 2"),
    ("zero passages (used to become one)", dict(num_passages=0), ValueError, "num_passages must be an integer >= 2"),
    ("negative delete_at", dict(delete_at=-1), ValueError, "delete_at must be an integer >= 0"),
    ("zero deletion_width", dict(deletion_width=0), ValueError, "deletion_width must be an integer >= 1"),
    ("float haystack_passages", dict(haystack_passages=2.5), TypeError, "haystack_passages must be an integer"),
    ("negative seed", dict(seed=-3), ValueError, "seed must be an integer >= 0"),
]


@pytest.mark.parametrize("row", THEORY_EDIT_ROWS, ids=[r[0] for r in THEORY_EDIT_ROWS])
def test_theory_edit_refuses(row):
    from sur_lab.studies.theory import theory_edit

    _, override, error, match = row
    with pytest.raises(error, match=match):
        theory_edit(None, "no-such-source", **override)


# ---- notebook parameters: declared ranges --------------------------------------------------------------------------
NOTEBOOK_RANGE_ROWS = [
    # (notebook, -p overrides, message pattern naming the parameter, the range and the value)
    ("00_quickstart", {"example_index": -1}, r"'example_index' must be >= 0 \(declared \{0..\}\); got -1"),
    ("00_quickstart", {"distractor_index": -2}, r"'distractor_index' must be >= 0"),
    ("00_quickstart", {"budgets": [5, 200]}, r"'budgets' must hold values in \[0, 100\].*got 200 \(item 1"),
    ("00_quickstart", {"budgets": []}, r"'budgets' must hold a list with len >= 1"),
    ("00_quickstart", {"max_new_tokens": 0}, r"'max_new_tokens' must be >= 1"),
    ("01_theory_bound", {"num_passages": 1}, r"'num_passages' must be >= 2"),
    ("01_theory_bound", {"deletion_width": 0}, r"'deletion_width' must be >= 1"),
    ("02_allocation_geometry", {"preset": "huge"}, r"'preset' must be one of 'smoke', 'default', 'paper'"),
    ("02_allocation_geometry", {"depths": [0.5, 1.5]}, r"'depths' must hold values in \[0, 1\]"),
    ("02_allocation_geometry", {"workers": 0}, r"'workers' must be >= 1"),
    ("02_allocation_geometry", {"references": ["Shift", "Reprefill"]}, r"'references' must hold values one of"),
    ("03_natural_qa_latency", {"datasets": ["hotpot"]}, r"'datasets' must hold values one of 'hotpotqa'"),
    ("03_natural_qa_latency", {"n_boot": 0}, r"'n_boot' must be >= 1"),
    ("04_packed_refresh_benchmark", {"overlap_budget": 0.0}, r"'overlap_budget' must be in \(0, 100\]"),
    ("04_packed_refresh_benchmark", {"num_intervals": [0, 4]}, r"'num_intervals' must hold values >= 1"),
    ("05_kernel_numerical_validation", {"kernel_dtypes": ["float8"]}, r"'kernel_dtypes' must hold values one of"),
    ("06_noprefix_reuse", {"required_preservation": 95.0}, r"'required_preservation' must be in \[0, 1\]"),
    ("07_agent_session", {"k": 11}, r"'k' must be in \[1, 10\] \(declared \{1..10\}\); got 11"),
    ("07_agent_session", {"debt_pct": 150.0}, r"'debt_pct' must be in \[0, 100\]"),
    ("07_agent_session", {"seed": -1}, r"'seed' must be >= 0"),
]


NOTEBOOK_RANGE_IDS = [f"{r[0][:2]} {next(iter(r[1]))}" for r in NOTEBOOK_RANGE_ROWS]


@pytest.mark.parametrize("row", NOTEBOOK_RANGE_ROWS, ids=NOTEBOOK_RANGE_IDS)
def test_notebook_parameters_outside_their_declared_range_are_refused(row):
    from sur_lab.runtime.params import ParameterRangeError, check_notebook_parameters

    name, overrides, match = row
    path = REPO / "notebooks" / f"{name}.ipynb"
    with pytest.raises(ParameterRangeError, match=match) as err:
        check_notebook_parameters(path, overrides)
    assert isinstance(err.value, ValueError) and str(err.value).startswith(f"{name}.ipynb: ")


def test_notebook_defaults_and_presets_lie_in_their_declared_ranges():
    import papermill as pm

    from sur_lab.runtime.params import _annotated, check_notebook_parameters, parameters_cell, parse_ranges
    from sur_lab.runtime.run_notebooks import smoke_parameters, suite_parameters

    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        source = parameters_cell(path)
        ranges = parse_ranges(source)
        annotated = {node.target.id: ast_annotation(node) for node, _ in _annotated(source)}
        # Every count, index, budget and size declares its range...
        numeric = {n for n, a in annotated.items() if a in ("int", "float")}
        assert numeric <= set(ranges), (path.name, sorted(numeric - set(ranges)))
        # ...without hiding a parameter from papermill (its parser skips a line holding two '=').
        assert set(pm.inspect_notebook(str(path))) == set(annotated), path.name
        for params in ({}, smoke_parameters(path), suite_parameters(path)):
            check_notebook_parameters(path, params)


def ast_annotation(node):
    import ast

    return ast.unparse(node.annotation)


def test_validate_parameters_reads_the_ranges_from_the_kernel_history():
    """Inside a kernel, ``validate_parameters(globals())`` finds the parameters cell in IPython's ``In`` history."""
    from sur_lab.runtime.params import ParameterRangeError, validate_parameters

    cell = "example_index: int = 0  # which example {0..}\nbudgets: list = [5]  # % {0..100, len 1..}"
    namespace = {"__annotations__": {"example_index": int, "budgets": list}, "In": ["", cell, "example_index = -1\n"],
                 "example_index": -1, "budgets": [5]}
    with pytest.raises(ParameterRangeError, match=r"'example_index' must be >= 0"):
        validate_parameters(namespace)
    namespace["example_index"] = 2
    validate_parameters(namespace)  # in range
    # Outside IPython (no history) only the types are checked, unless ranges are given.
    validate_parameters({"__annotations__": {"example_index": int}, "example_index": -1})


@pytest.mark.parametrize("spec", ["> = 0", "0..x", "len >= 1", ">= 0", "0...1", '"a" | b'])
def test_a_malformed_range_declaration_names_the_parameter(spec):
    from sur_lab.runtime.params import parse_ranges

    with pytest.raises(ValueError, match=r"parameter 'x': cannot read the declared range"):
        parse_ranges(f"x: int = 0  # a count {{{spec}}}")


# ---- the public API swept for the same kinds: counts, seeds, indexes, names ------------------------------------------
def _api_rows():
    from sur_lab import allowance, coalesce, continuation_nll, get_allocator, get_executor, segment_units, wrap_model
    from sur_lab.allocators import AllocationRequest
    from sur_lab.analysis.endpoints import reference_continuation
    from sur_lab.analysis.scoring import iirc_exact_match
    from sur_lab.analysis.decisions import paired_family, proportion_interval
    from sur_lab.edits import format_passages
    from sur_lab.models import cached_model_dir
    from sur_lab.repair import recover
    from sur_lab.runtime.run_notebooks import notebooks
    from sur_lab.session import EditSession

    return [
        # (label, fn(lm, prepared), error type, message pattern)
        ("coalesce unsorted (used to crash inside numpy)", lambda lm, pr: coalesce([3, 1, 2]), ValueError,
         r"positions must be strictly increasing"),
        ("coalesce duplicates", lambda lm, pr: coalesce([1, 1, 2]), ValueError, r"strictly increasing"),
        ("coalesce floats (used to give (1, 3))", lambda lm, pr: coalesce(np.array([1.5, 2.5])), TypeError,
         r"positions must be integers"),
        ("allowance of an integral float suffix_len", lambda lm, pr: allowance(10.0, 5), ValueError,
         r"suffix_len must be a non-negative integer; got 10.0"),
        ("repair seed 1.5 (used to run with seed 1)", lambda lm, pr: repair(lm, pr, "SUR", 20, seed=1.5), TypeError,
         r"seed must be an integer >= 0; got 1.5"),
        ("repair negative seed", lambda lm, pr: repair(lm, pr, "Random semantic units", 20, seed=-1), ValueError,
         r"seed must be an integer >= 0; got -1"),
        ("recover negative seed", lambda lm, pr: recover(lm, pr.edit, pr.dirty_cache, "SUR", 20, seed=-2), ValueError,
         r"seed must be an integer >= 0"),
        ("AllocationRequest negative seed", lambda lm, pr: AllocationRequest(lm, pr.edit, 20, seed=-1), ValueError,
         r"seed must be an integer >= 0"),
        ("EditSession seed 1.5", lambda lm, pr: EditSession(lm, seed=1.5), TypeError, r"seed must be an integer"),
        ("EditSession.delete seed -1", lambda lm, pr: _session_of(lm).delete(2, 4, seed=-1), ValueError,
         r"seed must be an integer >= 0"),
        ("get_executor of a list (used to be unhashable)", lambda lm, pr: get_executor(["packed"]), ValueError,
         r"executor name must be a string; got list"),
        ("get_allocator of None", lambda lm, pr: get_allocator(None), ValueError, r"allocator name must be a string"),
        ("continuation_nll id outside the vocabulary (used to be a RuntimeError)",
         lambda lm, pr: continuation_nll(lm, pr.shift_cache, pr.edit, [1000]), ValueError,
         r"continuation holds token id 1000 outside the vocabulary \[0, 96\)"),
        ("segment_units of a non-edit", lambda lm, pr: segment_units(5), TypeError, r"edit must be an EditedContext"),
        ("segment_units max_len 0", lambda lm, pr: segment_units(pr.edit, max_len=0), ValueError,
         r"max_len must be an integer >= 1"),
        ("paired_family n_boot 2.5", lambda lm, pr: paired_family({"a": [1.0, 2.0]}, kind="continuous", n_boot=2.5),
         TypeError, r"n_boot must be an integer >= 100; got 2.5"),
        ("paired_family n_boot 10", lambda lm, pr: paired_family({"a": [1.0, 2.0]}, kind="continuous", n_boot=10),
         ValueError, r"n_boot must be an integer >= 100"),
        ("proportion_interval k above n", lambda lm, pr: proportion_interval(3, 2), ValueError,
         r"k=3 must lie in \[0, n=2\]"),
        ("reference_continuation max_tokens 1.5", lambda lm, pr: reference_continuation([1, 2, 3], 1.5), TypeError,
         r"max_tokens must be an integer >= 1"),
        ("iirc_exact_match unknown answer_type (used to score False)",
         lambda lm, pr: iirc_exact_match("a", ["a"], "span"), ValueError, r"answer_type='span' is not one of"),
        ("wrap_model of a LoadedModel", lambda lm, pr: wrap_model(lm), TypeError, r"already a LoadedModel"),
        ("wrap_model of an int", lambda lm, pr: wrap_model(5), TypeError, r"model must be a transformers causal LM"),
        ("format_passages of a string", lambda lm, pr: format_passages("abc"), TypeError,
         r"passages must be a sequence of passages"),
        ("notebooks of a non-string pattern", lambda lm, pr: notebooks(5), TypeError,
         r"pattern must be a file-name glob"),
        ("cached_model_dir of a non-string key", lambda lm, pr: cached_model_dir(5, lambda p: None), ValueError,
         r"key=5 must be a plain folder name"),
    ]


def _session_of(lm):
    from sur_lab.session import EditSession

    session = EditSession(lm)
    session.append(list(range(20)))
    return session


API_ROWS = _api_rows()


@pytest.mark.parametrize("row", API_ROWS, ids=[r[0] for r in API_ROWS])
def test_public_api_refuses_out_of_range_arguments(lm, prepared, row):
    _, fn, error, match = row
    with pytest.raises(error, match=match):
        fn(lm, prepared)


def test_paired_bootstrap_refuses_non_integer_replicates_and_negative_seeds():
    import pandas as pd

    from sur_lab.analysis.stats import paired_bootstrap

    df = pd.DataFrame({"method": ["a", "b"] * 4, "correct": [1, 0, 1, 1, 0, 0, 1, 0],
                       "source_id": [0, 0, 1, 1, 2, 2, 3, 3], "dataset": ["d"] * 8})
    kwargs = dict(metric_col="correct", method_a="a", method_b="b")
    with pytest.raises(ValueError, match=r"n_boot must be an integer >= 1; got 2.0"):
        paired_bootstrap(df, n_boot=2.0, **kwargs)
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0; got -5"):
        paired_bootstrap(df, n_boot=10, seed=-5, **kwargs)
    assert paired_bootstrap(df, n_boot=np.int64(10), **kwargs).replicates.shape == (10,)


@pytest.mark.parametrize("containers", [((5, 2, "user"),), ((0, 999, "user"),), ((0, 3),), ((0.0, 3, "user"),)])
def test_segment_edit_refuses_reversed_or_out_of_range_containers(containers):
    """A reversed container used to be dropped silently (the semantic units then ignored that message boundary)."""
    from sur_lab.edits import segment_edit

    with pytest.raises(ValueError, match=r"containers must hold \(start, end, kind\) character spans"):
        segment_edit(None, "ab", "cd", "ef", "q", containers=containers)


@pytest.mark.parametrize("value,expected", [("", None), ("  ", None), ("~/x", "HOME/x"), ("rel/dir", "CWD/rel/dir")])
def test_model_cache_root_from_the_environment(monkeypatch, value, expected):
    """An empty SUR_LAB_CACHE used to put the model cache in the current directory ('.')."""
    import os

    from sur_lab.models import cache_root

    monkeypatch.setenv("SUR_LAB_CACHE", value)
    want = (Path.home() / ".cache" / "sur_lab" if expected is None else
            Path(expected.replace("HOME", str(Path.home())).replace("CWD", os.getcwd())))
    assert cache_root() == want and cache_root().is_absolute()
# Issue 24 (edit sessions): caches and models handed to repair_cache / EditSession.from_cache are checked against the
# model before any work; a StaticCache gives its filled rows, never its padding.
# =====================================================================================================================
from conftest import fp64_tol  # noqa: E402
from transformers import DynamicCache, EncoderDecoderCache  # noqa: E402

from sur_lab.cache_ops import max_abs_diff  # noqa: E402


def _reshaped(lm, ids, fn):
    return from_tensors([fn(k, v) for k, v in to_tensors(prefill(lm, torch.as_tensor(ids))[0])])


def _two_copies_of_each_head(k, v):
    return k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)


def _ragged(lm, ids):
    layers = to_tensors(prefill(lm, torch.as_tensor(ids))[0])
    layers[1] = (layers[1][0][:, :, :-1], layers[1][1][:, :, :-1])
    return from_tensors(layers)


CACHE_IN_ROWS = [
    # (id, cache builder (lm, ids) -> cache, error type, substring)
    ("None", lambda lm, ids: None, TypeError, "cache is None"),
    ("legacy tuple cache", lambda lm, ids: tuple(to_tensors(prefill(lm, torch.tensor(ids))[0])), TypeError,
     "cache is a legacy tuple"),
    ("legacy list cache", lambda lm, ids: list(to_tensors(prefill(lm, torch.tensor(ids))[0])), TypeError,
     "cache is a legacy list"),
    ("encoder-decoder cache", lambda lm, ids: EncoderDecoderCache(prefill(lm, torch.tensor(ids))[0], DynamicCache()),
     TypeError, "EncoderDecoderCache"),
    ("uninitialized DynamicCache", lambda lm, ids: DynamicCache(config=lm.model.config), ValueError, "not initialized"),
    ("head dim 8 (model 16)", lambda lm, ids: _reshaped(lm, ids, lambda k, v: (k[..., :8], v[..., :8])), ValueError,
     "head dim 8"),
    ("value head dim 8", lambda lm, ids: _reshaped(lm, ids, lambda k, v: (k, v[..., :8])), ValueError,
     "values have head"),
    ("4 KV heads (model 2)", lambda lm, ids: _reshaped(lm, ids, _two_copies_of_each_head), ValueError, "4 KV heads"),
    ("float32 cache of a float64 model", lambda lm, ids: _reshaped(lm, ids, lambda k, v: (k.float(), v.float())),
     ValueError, "float32"),
    ("layers of different lengths", _ragged, ValueError, "different numbers of rows"),
    ("batch of two", lambda lm, ids: _batch2(prefill(lm, torch.tensor(ids))[0]), ValueError, "batch"),
    ("two layers (model 3)", lambda lm, ids: from_tensors(to_tensors(prefill(lm, torch.tensor(ids))[0])[:2]),
     ValueError, "2 layers"),
]


@pytest.mark.parametrize("row", CACHE_IN_ROWS, ids=[r[0] for r in CACHE_IN_ROWS])
def test_caches_handed_in_are_checked_before_any_work(lm, row, monkeypatch):
    from sur_lab import EditSession, repair_cache

    _, build, error, match = row
    cache = build(lm, IDS)
    calls = []
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: calls.append(1))  # any model call would be recorded
    with pytest.raises(error, match=match):
        repair_cache(lm.model, cache, IDS, (4, 7))
    with pytest.raises(error, match=match):
        EditSession.from_cache(lm, cache, IDS)
    assert not calls


@pytest.mark.parametrize("model,error,match", [("a string", TypeError, "model must be"),
                                               (None, TypeError, "model must be"),
                                               (torch.nn.Linear(2, 2), TypeError, "model is a Linear")])
def test_repair_cache_names_a_model_that_is_not_one(lm, model, error, match):
    from sur_lab import repair_cache

    with pytest.raises(error, match=match):
        repair_cache(model, prefill(lm, torch.tensor(IDS))[0], IDS, (4, 7))


def test_repair_cache_takes_the_loaded_model_wrapper(lm):
    from sur_lab import repair_cache

    cache = prefill(lm, torch.tensor(IDS))[0]
    from_module = repair_cache(lm.model, cache, IDS, (4, 7), budget_pct=50)
    from_wrapper = repair_cache(lm, cache, IDS, (4, 7), budget_pct=50)
    assert max(max_abs_diff(from_module, from_wrapper)) == 0.0  # the same computation on the same inputs


def test_static_cache_gives_its_filled_rows_never_its_padding(lm):
    from transformers import StaticCache

    from sur_lab import EditSession, repair_cache

    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5))
    static = StaticCache(config=lm.model.config, max_cache_len=64)
    with torch.no_grad():
        lm.model(input_ids=ids[None], cache=static, use_cache=True)
    before = [t.clone() for layer in static.layers for t in (layer.keys, layer.values)]
    assert static.layers[0].keys.shape[2] == 64  # 24 rows of padding
    session = EditSession.from_cache(lm, static, ids)
    assert len(session) == 40 and session.cache.get_seq_length() == 40
    dynamic = prefill(lm, ids)[0]
    assert max(max_abs_diff(session.cache, dynamic)) <= fp64_tol(dynamic)
    out = repair_cache(lm.model, static, ids, (10, 18), budget_pct=100)
    assert out.get_seq_length() == 32
    clean = prefill(lm, torch.cat((ids[:10], ids[18:])))[0]
    assert max(max_abs_diff(out, clean)) <= fp64_tol(clean)
    after = [t for layer in static.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # not modified
    with torch.no_grad():  # the user keeps decoding into the StaticCache: the session's rows are its own
        lm.model(input_ids=ids[:3][None], cache=static, use_cache=True)
    assert max(max_abs_diff(session.cache, dynamic)) <= fp64_tol(dynamic)
