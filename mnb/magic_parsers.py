"""The old import path of :mod:`mnb.notebook.parsers` (the magics' flags, one parser per command).

The front end lives in ``mnb/notebook/``; this module keeps ``from mnb.magic_parsers import ...`` working.
"""

from mnb.notebook.parsers import (debug_parser, export_parser, layout_arguments, LAYOUT_FLAGS, layout_from_flags,
                                  megatron_parser, MNB_COMMANDS, parse_gpus, parse_ranks, plan_parser, plot_parser,
                                  profile_arguments, profile_parser, restart_parser, run_parser, stacks_parser,
                                  start_parser, status_parser, stop_parser, SUBCOMMAND_PARSERS)

__all__ = ["debug_parser", "export_parser", "layout_arguments", "LAYOUT_FLAGS", "layout_from_flags",
           "megatron_parser", "MNB_COMMANDS", "parse_gpus", "parse_ranks", "plan_parser", "plot_parser",
           "profile_arguments", "profile_parser", "restart_parser", "run_parser", "stacks_parser",
           "start_parser", "status_parser", "stop_parser", "SUBCOMMAND_PARSERS"]
