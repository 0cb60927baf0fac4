"""The old import path of :mod:`mnb.notebook.debug_commands` (``%mnb stacks`` and ``%mnb debug``).

The front end lives in ``mnb/notebook/``; this module keeps ``from mnb.debug_commands import ...`` working.
"""

from mnb.notebook.debug_commands import (debug_command, stacks_command)

__all__ = ["debug_command", "stacks_command"]
