"""Which warnings a rank shows in the cells and which go to the pool's log (``%mnb start --verbose``).

Kept out of ``mnb/worker/main.py`` (the rank's message loop): the list of known third-party
notices and the ``warnings.showwarning`` that routes them, installed at the start of
:func:`mnb.worker.boot.start` and again after Megatron's CPU mode adds its own filters.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

# Known third-party notices that Megatron-Core and torch raise while importing,
# building models or loading checkpoints, on every rank; they say nothing a
# notebook user can act on (mnb already chose the torch fallbacks).  They go to
# the pool's log (this rank's real stderr, which torchrun writes to
# ``mnb.pool().spec.log_file``), not to the cell; ``%mnb start --verbose``
# (MNB_VERBOSE=1 in the ranks' environment) shows them in the cells.  Every
# other warning reaches the cell's output as usual.  Patterns match the start of
# the message, case-insensitively (as ``warnings.filterwarnings`` does).
QUIET_WARNINGS = (
    # the TE / apex fallback notices (Megatron's optimizer, clip_grads, FSDP, norms)
    r"(Transformer Engine and )?Apex (is|are) not installed",
    r"(MimoModelConfig|MimoModel|ModalitySubmodules) is experimental",
    r"full scope is deprecated",
    # (on CUDA ranks mnb sets CUDA_DEVICE_MAX_CONNECTIONS=1; on CPU ranks it means nothing)
    r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment "
    r"variable CUDA_DEVICE_MAX_CONNECTIONS",
    # torch 2.13 deprecates the collectives Megatron-Core's tensor and sequence parallelism call
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    # torch inside Megatron's dist_checkpointing (mnb.save / mnb.load)
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to load in a single process",
    r"`load_state_dict` is deprecated and will be removed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    # torch's checkpoint API on Megatron 0.19's positional call (mnb.load)
    r"The argument order of (load|save) has been changed",
)

# Notices that are only known noise when a given library raises them: (message pattern, where it is raised,
# a part of the path).  The same message from the user's own code still reaches the cell.
QUIET_FROM = (
    # Megatron-Core's distributed optimizer in fp32 training zeroes `.grad` of its fp32 shards, views of the
    # parameters (optimizer.py's _zero_grad_group_helper, from mnb.train's optimizer.zero_grad()): harmless
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
     f"megatron{os.sep}core{os.sep}optimizer{os.sep}"),
)


def is_quiet(message: str, filename: str) -> bool:
    """Whether a warning is one of the known notices that go to the pool's log rather than the cell."""
    if _QUIET.match(message):
        return True
    return any(re.match(pattern, message, re.IGNORECASE) and where in filename for pattern, where in QUIET_FROM)


_QUIET = re.compile("|".join(f"(?:{pattern})" for pattern in QUIET_WARNINGS), re.IGNORECASE)


def verbose_warnings() -> bool:
    """Whether ``%mnb start --verbose`` asked for every warning in the cells (``MNB_VERBOSE=1``)."""
    return os.environ.get("MNB_VERBOSE", "").strip().lower() not in ("", "0", "false", "no")


def _to_log(rank: int, line: str) -> None:
    log_file = sys.__stderr__
    if log_file is None:
        return
    try:
        log_file.write(f"mnb rank {rank} (to the log; %mnb start --verbose shows it in cells): {line}")
        log_file.flush()
    except (OSError, ValueError):  # the log is gone: the rank is ending anyway
        pass


def route_warnings(rank: int, verbose: bool) -> None:
    """Send the known notices (:data:`QUIET_WARNINGS`) to the pool's log, or with ``verbose`` to the cell.

    Each is shown once per place it is raised (Python's "default" action; this
    also undoes the "ignore" filters Megatron's helpers or mnb's CPU mode set).
    Idempotent: call it again after code that adds its own filters.
    """
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("default", message=pattern)
    if not verbose:  # torchao's and torch's known log records (mnb.notices), imported with transformers
        from mnb import notices

        notices.route(lambda line: _to_log(rank, line))
    if verbose or getattr(warnings.showwarning, "_mnb_routed", False):
        return
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):  # warnings' signature
        log_file = sys.__stderr__
        if file is not None or log_file is None or not is_quiet(str(message), str(filename)):
            return show(message, category, filename, lineno, file, line)
        try:
            log_file.write(f"mnb rank {rank} (to the log; %mnb start --verbose shows it in cells): "
                           + warnings.formatwarning(message, category, filename, lineno, line))
            log_file.flush()
        except (OSError, ValueError):  # the log is gone: the rank is ending anyway
            pass
        return None

    showwarning._mnb_routed = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
