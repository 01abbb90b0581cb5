"""Edits from text (section 3.1), model support checks, and bad input refused before any model call."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model, tiny_config
from sur_lab.edits import build_edit, chat_edit, chat_prompt_ids, format_passages, token_edit
from sur_lab.models import UnsupportedModelError, check_supported, load_model, wrap_model
from sur_lab.repair import prepare, repair

DOCS, SPANS = format_passages(
    [("Alpha", "Alpha is a letter. It comes first."), ("Beta", "Beta follows alpha, 1,000 times."),
     ("Gamma", "Gamma is third.")]
)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_chat_edit_token_spans_match_text(smol_tokenizer, victim):
    edit = chat_edit(smol_tokenizer, DOCS, "Which letter is first?", SPANS[victim])
    tok = smol_tokenizer
    assert tok.decode(edit.original_ids[edit.prefix_len : edit.prefix_len + edit.deleted_len]) == DOCS[slice(*SPANS[victim])]
    # Token segments (issue 13): the edited ids are the clean documents' segment tokenization, not a re-tokenization.
    clean = chat_prompt_ids(tok, DOCS[: SPANS[victim][0]] + DOCS[SPANS[victim][1] :], "Which letter is first?")
    assert edit.edited_ids.tolist() + edit.query_ids.tolist() == clean.tolist()
    assert tok.decode(edit.edited_ids) == edit.edited_text
    assert edit.edited_text.endswith(DOCS[: SPANS[victim][0]] + DOCS[SPANS[victim][1] :])
    assert tok.decode(edit.query_ids).startswith("\n\nQuestion: Which letter is first?")
    assert edit.question_ids.tolist() == tok("Which letter is first?", add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_chat_edit_errors(smol_tokenizer):
    q = "Which letter is first?"
    with pytest.raises(ValueError, match="empty"):
        chat_edit(smol_tokenizer, DOCS, q, (5, 5))
    with pytest.raises(ValueError, match="out of range"):
        chat_edit(smol_tokenizer, DOCS, q, (-1, 4))
    with pytest.raises(ValueError, match="query"):
        chat_edit(smol_tokenizer, DOCS, q, (SPANS[2][0], len(DOCS) + 5))
    with pytest.raises(ValueError, match="documents must be a str"):
        chat_edit(smol_tokenizer, [DOCS], q, SPANS[1])
    with pytest.raises(ValueError, match="span=.*pair"):
        chat_edit(smol_tokenizer, DOCS, q, (0, 4, 8))
    with pytest.raises(ValueError, match="empty query"):
        chat_edit(smol_tokenizer, DOCS, "  ", SPANS[1])
    text = "Context: a b c."
    with pytest.raises(ValueError, match="reaches into the query"):
        build_edit(smol_tokenizer, text, " Question?", (8, len(text) + 3))


def test_token_edit_errors():
    ids = torch.arange(20)
    with pytest.raises(ValueError, match="deleted_len"):
        token_edit(ids, 3, 0, [1])
    with pytest.raises(ValueError, match="prefix_len"):
        token_edit(ids, 18, 5, [1])
    with pytest.raises(ValueError, match="empty query"):
        token_edit(ids, 3, 2, [])
    with pytest.raises(ValueError, match="batch size 1"):
        from sur_lab.edits import EditedContext

        EditedContext(ids.reshape(2, 10), torch.tensor([1]), 1, 1)


class _ExplodingModel(torch.nn.Module):
    """Stands in for a model: any forward is a test failure, proving validation happens first."""

    def forward(self, *args, **kwargs):
        raise AssertionError("model was called before input validation")


@pytest.mark.parametrize("budget", [-1, 100.5, float("nan")])
def test_bad_budget_raises_before_any_model_call(budget):
    lm = make_tiny_model("llama")
    edit = token_edit(torch.arange(30) % 96, 5, 4, [1, 2])
    prep = prepare(lm, edit)
    exploding = type(lm)(model=_ExplodingModel(), tokenizer=None, spec=lm.spec)
    with pytest.raises(ValueError, match="budget_pct"):
        repair(exploding, prep, "SUR", budget)
    with pytest.raises(ValueError,
                       match=r"method='No such allocator'; allowed: Dirty, Shift, Replay, Re-prefill, Erratum or"):
        repair(exploding, prep, "No such allocator", 5)
    with pytest.raises(ValueError, match="executor"):
        repair(exploding, prep, "SUR", 5, executor="nope")


@pytest.mark.parametrize(
    "kind,overrides,match",
    [
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention"] * 3}, "sliding"),
        ("llama", {"num_local_experts": 4}, "mixture-of-experts"),
        ("llama", {"model_type": "gpt2"}, "model_type"),
    ],
)
def test_unsupported_configurations_are_refused(kind, overrides, match):
    config = tiny_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        check_supported(config)


def test_yarn_and_llama3_rope_are_accepted():
    for rope in ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 512},
                 {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 512}):
        config = tiny_config("llama")
        config.rope_parameters = rope
        check_supported(config)


def test_load_model_from_local_path(tmp_path):
    lm = make_tiny_model("qwen3", dtype=torch.float32)
    lm.model.save_pretrained(tmp_path)
    # A tokenizer is needed by load_model; borrow a trivial one built from the tokenizers library.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1").save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.spec.model_type == "qwen3" and loaded.spec.num_kv_heads == 2 and loaded.spec.head_dim == 16
    assert not loaded.model.training


def test_load_model_refuses_unsupported_before_loading_weights(tmp_path):
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    config.save_pretrained(tmp_path)  # no weights at all: the refusal must come from the config check
    with pytest.raises(UnsupportedModelError, match="rope_type"):
        load_model(str(tmp_path))


def test_wrap_model_reports_spec():
    lm = make_tiny_model("llama")
    assert (lm.spec.num_layers, lm.spec.num_heads, lm.spec.num_kv_heads, lm.spec.head_dim) == (3, 4, 2, 16)
    assert lm.spec.gqa_group == 2 and lm.inv_freq.dtype == torch.float64 and lm.inv_freq.numel() == 8
    with pytest.raises(UnsupportedModelError):
        bad = make_tiny_model("llama").model
        bad.config.model_type = "gpt2"
        wrap_model(bad)
