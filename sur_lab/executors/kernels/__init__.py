"""Kernels for packed KV-cache repair: Triton indexed attention and indexed K/V writes, each with a PyTorch reference,
and the one-pass C++ CPU attention kernel (:mod:`sur_lab.executors.kernels.onepass`, compiled on first use).

Triton is optional: ``indexed_attention`` and ``indexed_scatter_kv`` launch Triton on CUDA tensors, on CPU tensors only
when ``TRITON_INTERPRET=1`` was set before this package was imported (Triton's interpreter; tests), and otherwise fall
back to the references in ``sur_lab.executors.kernels.reference``. Source: appendix 13.2, Eq. 21-24.
"""

from sur_lab.executors.kernels.indexed_attention import (
    HAS_TRITON,
    TRITON_INTERPRETED,
    IndexedAttentionPlan,
    build_indexed_attention_plan,
    indexed_attention,
    indexed_scatter_kv,
    uses_triton,
)
from sur_lab.executors.kernels.onepass import (
    OnePassPlan,
    build_onepass_plan,
    onepass_attention,
    onepass_available,
)
from sur_lab.executors.kernels.reference import (
    causal_attention_oracle,
    indexed_scatter_kv_reference,
    kernel_error_floor,
    packed_sdpa_reference,
)

__all__ = [
    "HAS_TRITON",
    "TRITON_INTERPRETED",
    "IndexedAttentionPlan",
    "OnePassPlan",
    "build_indexed_attention_plan",
    "build_onepass_plan",
    "causal_attention_oracle",
    "indexed_attention",
    "indexed_scatter_kv",
    "kernel_error_floor",
    "indexed_scatter_kv_reference",
    "onepass_attention",
    "onepass_available",
    "packed_sdpa_reference",
    "uses_triton",
]
