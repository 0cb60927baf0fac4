"""The old import path of :mod:`mnb.notebook.help` (the magics' help, generated from the parsers).

The front end lives in ``mnb/notebook/``; this module keeps ``from mnb.magic_help import ...`` working.
"""

from mnb.notebook.help import (before_script, help_end_transformer, mnb_help, mnb_overview, wants_help)

__all__ = ["before_script", "help_end_transformer", "mnb_help", "mnb_overview", "wants_help"]
