"""Loaded by every Python process of a test's multi-process launch (`tests/launching.py` puts this folder on
PYTHONPATH and sets STATELENS_RANK_HOOKS=1). In a rank (torchrun sets RANK), it makes an abort print every thread's
Python stack, and it says on stderr when the rank's script ran to its end without an uncaught exception, so that the
launcher can tell an abort during interpreter shutdown from one during the run."""

import atexit
import faulthandler
import os
import sys

FINISHED = "statelens-test: rank {} finished its script"

if os.environ.get("STATELENS_RANK_HOOKS") == "1" and "RANK" in os.environ:
    faulthandler.enable(all_threads=True)

    def _say_finished(rank=os.environ["RANK"]):
        # atexit runs as the interpreter starts shutting down; an uncaught exception has set sys.last_value by then
        if not hasattr(sys, "last_value"):
            print(FINISHED.format(rank), file=sys.stderr, flush=True)

    atexit.register(_say_finished)
