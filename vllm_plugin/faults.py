"""Fault injection for the kill-during-weight-copy test (``tests/test_hotload.py``); inert unless armed.

``ZEROKLD_FAULT_COPY_ARM=<path>`` in the server's environment names an arm file. While that file exists, a model's
``load_weights`` (a hot-load's in-place ``reload_weights``) calls :func:`copy_fault` after each tensor it has copied
into the live parameters: after the ``COPY_FAULT_AFTER``-th it writes ``<path>.copying`` (the test's cue that the
parameters now mix two snapshots) and sleeps, so a SIGKILL lands inside the copy itself.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

COPY_FAULT_AFTER = 3
COPY_FAULT_SLEEP_S = 120.0


def copy_fault(copied: int) -> None:
    """Called with the number of tensors copied so far; pauses mid-copy when armed (see the module docstring)."""
    arm = os.environ.get("ZEROKLD_FAULT_COPY_ARM")
    if not arm or copied != COPY_FAULT_AFTER or not Path(arm).exists():
        return
    Path(arm + ".copying").write_text(str(os.getpid()))
    time.sleep(COPY_FAULT_SLEEP_S)
