"""The old import path of :mod:`mnb.notebook.workshop` (the workshop notebooks' exercise checks).

The checks live in ``mnb/notebook/``; this module keeps ``from mnb.workshop import ...`` (what the
notebooks write) working.
"""

from mnb.notebook.workshop import check_equal, check_number, NotRight

__all__ = ["check_equal", "check_number", "NotRight"]
