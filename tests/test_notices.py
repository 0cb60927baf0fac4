"""Known third-party notices (mnb.notices) go to the pool's log, not the cell: torchao's C extensions that
do not load, torch's enum notice, peft's call of a deprecated transformers property; anything else still
shows.  Through a real IPython shell (``%load_ext mnb``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

TORCHAO = ("Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
           "Could not load this library")
ENUM = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
        "Calling register_constant() on Enum subclasses is deprecated")
DEPRECATED = "`is_gradient_checkpointing` is deprecated and will be removed in v6."

SCRIPT = textwrap.dedent(f"""
    import logging, sys, warnings
    from IPython.core.interactiveshell import InteractiveShell

    seen = []
    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    mnb_log = logging.getLogger("mnb")
    mnb_log.setLevel(logging.DEBUG)
    mnb_log.addHandler(Collect())
    InteractiveShell.instance().run_line_magic("load_ext", "mnb")
    warnings.simplefilter("always")
    logging.getLogger("torchao").warning({TORCHAO!r})
    logging.getLogger("torch.utils._pytree").warning({ENUM!r}, "<enum 'KernelPreference'>")
    logging.getLogger("torchao").warning("torchao: a notice mnb does not know")
    warnings.warn_explicit({DEPRECATED!r}, FutureWarning, "/site-packages/transformers/modeling_utils.py", 3312)
    warnings.warn_explicit({DEPRECATED!r}, FutureWarning, "/home/me/my_code.py", 7)
    print("ROUTED", len(seen), " || ".join(seen))
""")


def test_known_notices_leave_the_kernels_output():
    """Without a pool: the known ones reach mnb's debug log only; the others print as before."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, MNB_STANDBY_AT_LOAD="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    err, routed = proc.stderr, proc.stdout.split("ROUTED", 1)[1]
    assert "Failed to load" not in err and "Enum subclass" not in err, err
    assert "a notice mnb does not know" in err, err
    assert err.count("is_gradient_checkpointing") == 1 and "my_code.py" in err, err  # the user's own: shown
    assert routed.split()[0] == "3", routed
    for part in ("_C_mxfp8", "KernelPreference", "modeling_utils.py"):
        assert part in routed, routed


def test_known_notices_go_to_the_pool_log(shell, module_pool, caplog):
    """With a pool: the kernel appends them to the pool's log, beside the ranks' lines."""
    log_file = module_pool.spec.log_file
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning(TORCHAO)
        logging.getLogger("torch.utils._pytree").warning(ENUM, "<enum 'ScaleCalculationMode'>")
        logging.getLogger("torchao").warning("torchao: another notice mnb does not know")
    shown = caplog.text
    assert "Failed to load" not in shown and "Enum subclass" not in shown, shown
    assert "another notice mnb does not know" in shown, shown
    text = log_file.read_text(errors="replace")
    assert f"mnb kernel (to the log): torchao WARNING: {TORCHAO}" in text, text[-2000:]
    assert "<enum 'ScaleCalculationMode'> is an Enum subclass" in text, text[-2000:]
