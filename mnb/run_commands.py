"""The old import path of :mod:`mnb.notebook.run_commands` (``%mnb run`` and how a request's end is shown).

The front end lives in ``mnb/notebook/``; this module keeps ``from mnb.run_commands import ...`` working.
"""

from mnb.notebook.run_commands import (kernel_changes, pool_request, require_pool, run_command, run_isolated)

__all__ = ["kernel_changes", "pool_request", "require_pool", "run_command", "run_isolated"]
