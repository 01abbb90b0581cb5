"""Bad inputs are refused, not reinterpreted (issue 12, kinds 5, 6 and 8a/8b): one row per input, with the expected
error (type and a substring naming the argument) or value.

Rows cover token-level edits, composed prompts, supports, the forward entry points, the sequential executor, greedy
decoding, model loading, context length, reference methods and the whole-context deletion. ``chat_edit`` inputs and
the notebook runner's ``-p`` are tested with their owners' modules.
"""

from __future__ import annotations

import warnings

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
