"""The old import path of :mod:`mnb.megatron_lm.export_args` (Megatron-LM's ``pretrain_gpt.py`` arguments).

The export lives in ``mnb/megatron_lm/``; this module keeps ``from mnb.export_args import ...`` working.
"""

from mnb.megatron_lm.export_args import megatron_lm_args

__all__ = ["megatron_lm_args"]
