"""A training's run on the notebook side: the ranks' records and what they say.

:mod:`.runs` holds :class:`~mnb.analysis.runs.Run` (the records of one training, ``mnb.last_run``) and
``as_run``; :mod:`.run_memory` compares the measured memory with the estimate, :mod:`.run_pipeline` reads
the pipeline's timeline and bubbles, :mod:`.run_summary` writes the summary text.  Below the controller
(its registry makes a ``Run`` of each training's records) and above ``mnb.estimate`` and ``mnb.plot``;
never the pool, the front end or the rank side.  The old paths (``mnb.runs``, ``mnb.run_memory``, ...)
re-export it.  Imports nothing here.  Torch-free.
"""
