"""The old import path of :mod:`mnb.notebook.pool_commands` (``%mnb start|status|stop|restart``).

The front end lives in ``mnb/notebook/``; this module keeps ``from mnb.pool_commands import ...`` working.
"""

from mnb.notebook.pool_commands import (attach_live_progress, format_table, ranks_per_node, restart_command,
                                        slurm_request, start_command, status_command, stop_command)

__all__ = ["attach_live_progress", "format_table", "ranks_per_node", "restart_command", "slurm_request",
           "start_command", "status_command", "stop_command"]
