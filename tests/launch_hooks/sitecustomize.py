"""Loaded by every Python process of a test's multi-process launch (`tests/launching.py` puts this folder on
PYTHONPATH and sets STATELENS_RANK_HOOKS=1). In a rank (torchrun sets RANK), it makes an abort print every thread's
Python stack, and it says on stderr, with the rank's pid, when the rank's script ran to its end, so that the launcher
can tell an abort during interpreter shutdown from one during the run.

"Ran to its end": the script's module code returned, or the script called `sys.exit` with a success status (None,
0), and no exception went uncaught. A failure by `SystemExit` (`sys.exit("...")`, `raise SystemExit(1)`, argparse's
errors) does not count, although it sets no `sys.last_value`. Only the rank itself says it: the hook takes
STATELENS_RANK_HOOKS out of the environment its child processes inherit, and a forked child (same atexit handlers)
has another pid, which the launcher checks against torchrun's failure table.
"""

import _thread
import atexit
import faulthandler
import opcode
import os
import sys

FINISHED = "statelens-test: rank {} (pid {}) finished its script"

if os.environ.get("STATELENS_RANK_HOOKS") == "1" and "RANK" in os.environ:
    del os.environ["STATELENS_RANK_HOOKS"]  # the rank's own: a Python child (RANK, PYTHONPATH inherited) runs without
    faulthandler.enable(all_threads=True)
    _RANK, _PID = os.environ["RANK"], os.getpid()
    _RETURNS = {opcode.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in opcode.opmap}
    _main_frame = []  # the frame of the script's module code, once it runs
    _exit_statuses = []  # what the script passed to sys.exit

    def _find_main_frame(frame, event, arg):
        # a trace function only until the script's module code starts (nothing else runs in between for a script
        # path; runpy's imports for `-m`); it traces nothing inside (returns None)
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            _main_frame.append(frame)
            sys.settrace(None)

    if sys.gettrace() is None:  # not under a tracer of its own (coverage, a debugger): keep that one
        sys.settrace(_find_main_frame)

    _sys_exit, _main_thread = sys.exit, _thread.get_ident()

    def _exit(status=None, /):
        if _thread.get_ident() == _main_thread:  # in another thread it ends only that thread
            _exit_statuses.append(status)
        _sys_exit(status)

    _exit.__doc__ = _sys_exit.__doc__
    sys.exit = _exit  # argparse's errors (`parser.exit`) call it too

    def _ran_to_its_end() -> bool:
        # atexit runs as the interpreter starts shutting down; an uncaught exception has set sys.last_value by then,
        # an uncaught SystemExit has not
        if hasattr(sys, "last_value") or os.getpid() != _PID:
            return False
        status = _exit_statuses[-1] if _exit_statuses else None
        exited_well = status is None or (isinstance(status, int) and status == 0)  # SystemExit's exit status 0
        if not _main_frame:  # the module code was not seen (under another tracer): the sys.exit status decides
            return exited_well
        frame = _main_frame[0]  # a finished frame keeps its last instruction: a return, or the one that raised
        code = frame.f_code.co_code
        returned = 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] in _RETURNS
        return returned or (bool(_exit_statuses) and exited_well)

    def _say_finished():
        if _ran_to_its_end():
            print(FINISHED.format(_RANK, _PID), file=sys.stderr, flush=True)

    atexit.register(_say_finished)
