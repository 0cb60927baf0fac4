"""The notebook's layout as a Megatron-LM launch: ``mnb.export`` and ``%mnb export`` (notebook side, pure Python).

Not :mod:`mnb.megatron` (the ranks' Megatron-Core code): this package writes what runs Megatron-LM's own
``pretrain_gpt.py`` elsewhere.  :mod:`.export_args` builds its argument list and notes; :mod:`.exports`
resolves the settings (the notebook's last ones, from the registry) and writes the torchrun line or the
sbatch script (rendered by ``mnb.launch_templates``, which the Slurm launcher shares).  The controller
never imports it; the old paths ``mnb.exports`` and ``mnb.export_args`` re-export it.  Imports nothing here.
"""
