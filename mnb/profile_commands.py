"""The old import path of :mod:`mnb.notebook.profile_commands` (``%%megatron --profile`` requests and ``%mnb profile``).

The front end lives in ``mnb/notebook/``; this module keeps ``from mnb.profile_commands import ...`` working.
"""

from mnb.notebook.profile_commands import (profile_request, run_profile_command, take_profile)

__all__ = ["profile_request", "run_profile_command", "take_profile"]
