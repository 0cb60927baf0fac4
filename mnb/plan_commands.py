"""The old import path of :mod:`mnb.notebook.plan_commands` (``%mnb plan`` and ``%mnb export``).

The front end lives in ``mnb/notebook/``; this module keeps ``from mnb.plan_commands import ...`` working.
"""

from mnb.notebook.plan_commands import (calibrated_gpu, export_command, plan_command)

__all__ = ["calibrated_gpu", "export_command", "plan_command"]
