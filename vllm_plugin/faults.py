"""Fault injection for the hot-load tests (``tests/servers/test_hotload.py``,
``tests/servers/test_lora_hotload.py``); inert unless armed.

``ZEROKLD_FAULT_COPY_ARM=<path>`` in the server's environment names an arm file. While that file exists, a model's
``load_weights`` (a hot-load's in-place ``reload_weights``) calls :func:`copy_fault` after each tensor it has copied
into the live parameters: after the ``COPY_FAULT_AFTER``-th it writes ``<path>.copying`` (the test's cue that the
parameters now mix two snapshots) and sleeps, so a SIGKILL lands inside the copy itself.

``ZEROKLD_FAULT_STEP_DELAY_ARM=<path>`` names another: while it exists, each forward of the model (one engine step)
first sleeps the seconds the file holds (:func:`step_delay`). A request then stays in flight for at least its token
count times that delay, however fast the machine decodes, and the sleeping worker leaves its core to the API server
and the test: the tests that need a request still running while a hot-load signal is handled (a sync drain, a swap
in the middle of a stream) arm it. (Without it such a request once ended before the signal was verified: on 2 cores
the engine core's busy loop and the worker each hold a core while a request runs, and the API server and the test
share what is left.)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from zerokld_plugins import envs

COPY_FAULT_AFTER = 3
COPY_FAULT_SLEEP_S = 120.0


def copy_fault(copied: int) -> None:
    """Called with the number of tensors copied so far; pauses mid-copy when armed (see the module docstring)."""
    arm = envs.ZEROKLD_FAULT_COPY_ARM
    if arm is None or copied != COPY_FAULT_AFTER or not arm.exists():
        return
    Path(str(arm) + ".copying").write_text(str(os.getpid()))
    time.sleep(COPY_FAULT_SLEEP_S)


def step_delay() -> None:
    """Called at the start of each model forward; sleeps while armed (see the module docstring).

    Raises:
        ValueError: the arm file does not hold a number of seconds.
    """
    arm = envs.ZEROKLD_FAULT_STEP_DELAY_ARM
    if arm is None:
        return
    try:
        seconds = arm.read_text()
    except FileNotFoundError:
        return
    time.sleep(float(seconds))
