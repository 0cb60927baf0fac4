"""The old import path of :mod:`mnb.notebook.profiles` (the ranks' profiler traces merged on one clock).

Profiles live in ``mnb/notebook/``; this module keeps ``from mnb.profiles import ...`` working.
"""

from mnb.notebook.profiles import (ALIGNMENT_SLACK_US, CLOCK_PREFIX, COMM_PREFIX, COMM_TID, delete_profile, is_comm,
                                   last_profile, list_profiles, MAX_TRACE_BYTES, Profile, PROFILE_ENTRIES,
                                   set_last_profile, STEP_PREFIX)

__all__ = ["ALIGNMENT_SLACK_US", "CLOCK_PREFIX", "COMM_PREFIX", "COMM_TID", "delete_profile", "is_comm", "last_profile",
           "list_profiles", "MAX_TRACE_BYTES", "Profile", "PROFILE_ENTRIES", "set_last_profile", "STEP_PREFIX"]
