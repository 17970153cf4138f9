"""Start a measuring worker the way the training launcher starts a rank: in a session of its own."""

from __future__ import annotations

import contextlib
import os


def own_session() -> None:
    """Move this process into a new session, as torch's elastic launcher does with every rank it starts.

    Linux's scheduler with autogroup (the default on desktop and many server kernels) shares the
    CPU fairly between sessions first and between the threads of a session second. Workers left in
    the calibrating process's session would split that one session's share on a host that other
    jobs load, where each rank of `megascale train --nproc N` gets a share of its own: the probe
    would measure about half the cores a two-rank run really gets.
    """
    if hasattr(os, "setsid"):
        with contextlib.suppress(OSError):  # already a session leader
            os.setsid()


__all__ = ["own_session"]
