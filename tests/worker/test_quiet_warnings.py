"""Which warnings go to the pool's log: a notice known as noise only where a library raises it."""

from __future__ import annotations

import os

from mnb.worker.quiet_warnings import is_quiet

NON_LEAF = ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute "
            "won't be populated during autograd.backward().")


def test_megatrons_non_leaf_grad_notice_is_quiet_only_from_its_optimizer():
    megatron = os.path.join("site-packages", "megatron", "core", "optimizer", "optimizer.py")
    assert is_quiet(NON_LEAF, megatron)
    assert not is_quiet(NON_LEAF, "/home/me/<ipython-input-3>")  # the user's own mistake still shows
    assert not is_quiet("something else", megatron)
    assert is_quiet("Apex is not installed", "/anywhere.py")  # the message-only notices as before
