"""Rank side of mnb: ``python -m mnb.worker``, started by torchrun (see main.py)."""
