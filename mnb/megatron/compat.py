"""Fixes for megatron-core bugs that are not about CUDA (applied on every device).

Called by :func:`mnb.megatron.model.gpt` before building a model; idempotent.

- megatron-core 0.16.1 ``transformer/moe/moe_utils.py`` binds ``te_general_gemm``
  only when Transformer Engine imports, but ``RouterGatingLinearFunction`` reads
  it unconditionally (``if te_general_gemm is not None``): without TE every MoE
  forward raises ``NameError``.  We define it as None, the value the code expects
  when TE is absent.
"""

from __future__ import annotations


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
