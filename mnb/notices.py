"""Known third-party notices that importing transformers, peft or torchao prints, routed to the pool's
log instead of the cell: one list, used by the kernel (``%load_ext mnb``) and by every rank.

Importing ``transformers``' model classes imports its torchao quantizer, which imports torchao
when it is installed; torchao then logs that its prebuilt C extensions do not load (they are built
for another Python or torch; mnb's FP8 linears do not use them) and torch logs that torchao
registers enums it no longer needs to.  ``PeftModel.from_pretrained`` calls a transformers property
that warns it is deprecated.  None of it is anything a notebook user can act on.

- :data:`QUIET_LOGS`: ``logging`` records, by logger name and the start of the message.
- :data:`QUIET_KERNEL_WARNINGS`: ``warnings`` in the kernel, by message and where they are raised
  (the ranks' own list is :mod:`mnb.worker.quiet_warnings`).

:func:`route` installs both (idempotent: a later call only changes where they are written).
Imports nothing of mnb and no third-party package.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable

QUIET_LOGS: tuple[tuple[str, str], ...] = (
    ("torchao", r"Failed to load .*torchao.*_C"),
    ("torchao", r"Skipping import of cpp extensions"),
    ("torch.utils._pytree", r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile"),
)
"""(logger, pattern matched at the start of the message): records that go to the pool's log."""

QUIET_KERNEL_WARNINGS: tuple[tuple[str, str], ...] = (
    # peft 0.21's PeftModel.from_pretrained reads a property transformers 5 deprecates
    (r"`is_gradient_checkpointing` is deprecated", f"transformers{os.sep}modeling_utils.py"),
)
"""(pattern matched at the start of the message, a part of the file that raises it)."""

_writer: dict[str, Callable[[str], None]] = {}


class _Route(logging.Filter):
    """Passes every record but the known ones, which it hands to the writer instead."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: not one of ours
            return True
        if not self.pattern.match(message):
            return True
        write = _writer.get("write")
        if write is not None:
            write(f"{record.name} {record.levelname}: {message}\n")
        return False


def is_quiet_warning(message: str, filename: str) -> bool:
    return any(re.match(p, message) and where in filename for p, where in QUIET_KERNEL_WARNINGS)


def route(write: Callable[[str], None], *, kernel_warnings: bool = False) -> None:
    """Hand the known notices to ``write`` (one line each) instead of printing them.

    ``kernel_warnings``: also the kernel's known ``warnings`` (:data:`QUIET_KERNEL_WARNINGS`).
    Each logger gets one filter, however often this is called.
    """
    _writer["write"] = write
    by_logger: dict[str, list[str]] = {}
    for name, pattern in QUIET_LOGS:
        by_logger.setdefault(name, []).append(pattern)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Route) for f in logger.filters):
            logger.addFilter(_Route(patterns))
    if not kernel_warnings or getattr(warnings.showwarning, "_mnb_notices", False):
        return
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):  # warnings' signature
        if file is None and is_quiet_warning(str(message), str(filename)):
            target = _writer.get("write")
            if target is not None:
                target(warnings.formatwarning(message, category, filename, lineno, line))
            return None
        return show(message, category, filename, lineno, file, line)

    showwarning._mnb_notices = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
