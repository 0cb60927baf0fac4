"""The old import path of :mod:`mnb.notebook.magics` (the ``%mnb`` and ``%%megatron`` magics).

The front end lives in ``mnb/notebook/``; this module keeps ``from mnb.magics import ...`` working.
"""

from mnb.notebook.magics import (help_end_transformer, LAYOUT_FLAGS, megatron_parser, MegatronMagics, MNB_COMMANDS,
                                 parse_ranks, register, requested_layout, SUBCOMMAND_PARSERS, unregister)

__all__ = ["help_end_transformer", "LAYOUT_FLAGS", "megatron_parser", "MegatronMagics", "MNB_COMMANDS",
           "parse_ranks", "register", "requested_layout", "SUBCOMMAND_PARSERS", "unregister"]
