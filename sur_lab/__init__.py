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

from sur_lab.allocators import ALLOCATORS, register_allocator
from sur_lab.answer import Answer, answer
from sur_lab.edits import EditedContext, build_edit, chat_edit
from sur_lab.executors import EXECUTORS, register_executor
from sur_lab.model_check import ModelCheckReport, check_model
from sur_lab.models import LoadedModel, load_model
from sur_lab.repair import PreparedEdit, RepairResult, prepare, recover, repair
from sur_lab.session import EditRecord, EditSession
from sur_lab.sync import SyncPolicy, SyncRecord

__version__ = "0.1.0"

#: The user-facing names: load a model, build an edit, prepare / repair / recover its cache, answer, sessions and
#: their sync, the allocator and executor registries, the result types and the per-model check. Every other helper is
#: imported from its module (``from sur_lab.executors import shift``, ``from sur_lab.budget import allowance``).
__all__ = [
    "ALLOCATORS",
    "EXECUTORS",
    "Answer",
    "EditRecord",
    "EditSession",
    "EditedContext",
    "LoadedModel",
    "ModelCheckReport",
    "PreparedEdit",
    "RepairResult",
    "SyncPolicy",
    "SyncRecord",
    "answer",
    "build_edit",
    "chat_edit",
    "check_model",
    "load_model",
    "prepare",
    "recover",
    "register_allocator",
    "register_executor",
    "repair",
]
