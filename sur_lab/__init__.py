"""sur_lab: budgeted KV-cache repair after context deletion (Semantic-Unit Refresh and its executors).

Quick use::

    from sur_lab import load_model, chat_edit, prepare, repair, answer
    lm = load_model()                                   # embedded SmolLM2-135M-Instruct
    edit = chat_edit(lm.tokenizer, documents, question, span=(start, end))
    prepared = prepare(lm, edit)                        # Dirty prefill + Shift, shared by all methods
    result = repair(lm, prepared, "SUR", budget_pct=5)  # allocator + sequential executor
    print(answer(lm, result.cache, edit).text)

Source: "Budgeted KV-Cache Repair for Evolving Contexts" (section 3, appendix 7 and 13).
"""

from sur_lab.allocators import (
    ALLOCATORS,
    AllocationRequest,
    Selection,
    allocate,
    get_allocator,
    register_allocator,
)
from sur_lab.answer import Answer, answer, continuation_nll
from sur_lab.budget import BudgetFractionWarning, Support, allowance, coalesce, fractions_expected
from sur_lab.edits import (
    EditedContext,
    build_edit,
    chat_edit,
    chat_prompt_ids,
    chat_segments,
    format_passages,
    render_chat,
    segment_edit,
    token_edit,
)
from sur_lab.executors import (
    EXECUTORS,
    dirty,
    get_executor,
    register_executor,
    replay,
    reprefill,
    shift,
)
from sur_lab.models import (
    EMBEDDED_MODEL,
    LoadedModel,
    ModelSpec,
    UnsupportedModelError,
    load_model,
    wrap_model,
)
from sur_lab.repair import (
    REFERENCE_METHODS,
    PreparedEdit,
    RepairResult,
    prepare,
    recover,
    repair,
)
from sur_lab.model_check import ModelCheckError, ModelCheckReport, check_model
from sur_lab.session import EditRecord, EditSession, repair_cache
from sur_lab.sync import SyncPolicy, SyncRecord
from sur_lab.units import Unit, segment_units

__version__ = "0.1.0"

__all__ = [
    "ALLOCATORS",
    "EMBEDDED_MODEL",
    "EXECUTORS",
    "REFERENCE_METHODS",
    "AllocationRequest",
    "Answer",
    "BudgetFractionWarning",
    "EditRecord",
    "EditSession",
    "EditedContext",
    "LoadedModel",
    "ModelCheckError",
    "ModelCheckReport",
    "ModelSpec",
    "PreparedEdit",
    "RepairResult",
    "Selection",
    "Support",
    "SyncPolicy",
    "SyncRecord",
    "Unit",
    "UnsupportedModelError",
    "allocate",
    "allowance",
    "answer",
    "build_edit",
    "chat_edit",
    "chat_prompt_ids",
    "chat_segments",
    "check_model",
    "coalesce",
    "continuation_nll",
    "dirty",
    "format_passages",
    "fractions_expected",
    "get_allocator",
    "get_executor",
    "load_model",
    "prepare",
    "recover",
    "register_allocator",
    "register_executor",
    "render_chat",
    "repair",
    "repair_cache",
    "replay",
    "reprefill",
    "segment_edit",
    "segment_units",
    "shift",
    "token_edit",
    "wrap_model",
]
