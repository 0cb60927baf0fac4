"""The old import path of :mod:`mnb.megatron_lm.exports` (``mnb.export``: Megatron-LM / torchrun / Slurm launches).

The export lives in ``mnb/megatron_lm/``; this module keeps ``from mnb.exports import ...`` working.
"""

from mnb.megatron_lm.exports import (check_output, check_target, connections_line, export, EXPORT_MARK, Exported,
                                     format_args, is_export, KINDS, RDZV_PORT)

__all__ = ["check_output", "check_target", "connections_line", "export", "EXPORT_MARK", "Exported", "format_args",
           "is_export", "KINDS", "RDZV_PORT"]
