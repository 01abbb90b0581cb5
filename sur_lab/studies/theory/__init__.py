"""The theory behind budgeted repair, made measurable: the mixed-cache error bound (appendix 14, Eq. 25–28) and the
cost model of budgeted recomputation (appendix 13.1, Eq. 15–19).

Three parts:

* **Proposition 14.1 on tensors.** :func:`mixed_cache_bound` evaluates, for one attention head and a set of query rows,
  the left side ``‖o_i^A − o_i^⋆‖₂``, both terms of Eq. 25 with ``M_V``, the intermediate Eq. 27, the logit bound of
  Eq. 26 with ``Q^⋆`` and ``K^⋆``, and the fixed-attention approximation Eq. 28, all in float64.
* **Proposition 14.1 on a real model.** :class:`AttentionCapture` records, during ordinary forwards, the query vectors
  (after Q/K normalization and RoPE, exactly as the model's attention function receives them) and the attention outputs
  of sampled layers and heads. :func:`refresh_with_queries` runs the interval-wise ``"sequential"`` executor under the
  capture (cache A and ``q^A`` of every refreshed position); :func:`replay_with_queries` does the same for full-suffix
  Replay (cache ⋆ and ``q^⋆``). Keys and values come from the final caches: in the interval-wise executor an interval
  ``[a, b)`` reads rows ``[0, a)`` that no later interval rewrites, plus its own fresh rows, so the final cache A holds
  exactly the K/V that refreshed position i attended to (likewise for Replay). Only the sampled heads' rows of the
  attention matrix are ever formed (``n_rows × N`` per head); no ``N × N`` matrix is built. :func:`bound_study` joins
  them into one row per (budget, layer, head, refreshed position).
* **Cost model.** Token-layer ratio (Eq. 15), useful-arithmetic FLOPs (Eq. 16–17, formula in :func:`token_flops`),
  the causal-pair count ``M(U) = Σ_{u∈U} (u + 1)`` and its bound (Eq. 18), and the traversal-overhead model (Eq. 19)
  fitted by non-negative least squares to measured refresh times (:func:`fit_traversal_model`).

Scaling: the paper writes logits as ``⟨q, k⟩ / √d_h``; the model's attention modules carry their own ``scaling``
(``d_h^{-1/2}`` for Llama, Mistral, Qwen2 and Qwen3), which is what the capture records and the bound uses.
"""

from sur_lab.studies.theory.bound import (  # noqa: F401
    AttentionCapture,
    BoundTerms,
    CapturedRows,
    bound_rounding_allowance,
    bound_rows,
    bound_study,
    bound_summary,
    causal_attention_rows,
    eq28_table,
    evenly_spaced_layers,
    kv_head_of,
    mixed_cache_bound,
    refresh_with_queries,
    replay_with_queries,
    sample_rows,
    theory_edit,
)
from sur_lab.studies.theory.cost import (  # noqa: F401
    PACKED_EXECUTORS,
    TraversalFit,
    available_executors,
    causal_pairs,
    cost_table,
    fit_traversal_model,
    max_pairs,
    pair_flops,
    pair_ratio_bound,
    replay_pairs,
    spread_support,
    time_refresh,
    timing_study,
    token_flops,
    token_layer_ratio,
    traversals,
    useful_flops,
)

__all__ = [
    "AttentionCapture",
    "BoundTerms",
    "CapturedRows",
    "PACKED_EXECUTORS",
    "TraversalFit",
    "available_executors",
    "bound_rounding_allowance",
    "bound_rows",
    "bound_study",
    "bound_summary",
    "causal_attention_rows",
    "causal_pairs",
    "cost_table",
    "eq28_table",
    "evenly_spaced_layers",
    "fit_traversal_model",
    "kv_head_of",
    "max_pairs",
    "mixed_cache_bound",
    "pair_flops",
    "pair_ratio_bound",
    "refresh_with_queries",
    "replay_pairs",
    "replay_with_queries",
    "sample_rows",
    "spread_support",
    "theory_edit",
    "time_refresh",
    "timing_study",
    "token_flops",
    "token_layer_ratio",
    "traversals",
    "useful_flops",
]
