"""The notebook's front end: ``%mnb`` and ``%%megatron``.

One module per concern: :mod:`.magics` parses a line and dispatches (``register`` is what
``%load_ext mnb`` calls); :mod:`.parsers` holds every command's flags (shared argument groups,
one ``parse_ranks``, one ``layout_from_flags``); :mod:`.help` generates the help from the parsers;
each command group has its module (:mod:`.pool_commands`, :mod:`.run_commands`, :mod:`.debug_commands`,
:mod:`.plan_commands`, :mod:`.profile_commands`), handed the pool.  The notebook's own: :mod:`.profiles`
(a profiled cell's traces merged on one clock, ``mnb.last_profile``), :mod:`.workshop` (the exercise
checks), :mod:`.config_reference` (docs/config.md).  Nothing below the front end imports it
(tests/test_imports.py); the old paths (``mnb.magics``, ``mnb.magic_parsers``, ``mnb.profiles``, ...) re-export it.
Imports nothing here, so ``import mnb.notebook.parsers`` stays light.  Torch-free.
"""
