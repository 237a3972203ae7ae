"""Launching a test's ranks: `accelerate launch` (torchrun underneath) of a script on 2 processes, one thread each.

Every rank loads `tests/launch_hooks/sitecustomize.py`: an abort prints each thread's Python stack, and a rank whose
script ran to its end says so, with its pid (not a rank that exited by a failing `SystemExit`, nor a child process of
the rank). That is how `launch` tells the one failure it forgives from a real one: a rank's word counts only with the
pid torchrun's failure table gives that rank.

The forgiven failure: under DeepSpeed, gloo's process groups outlive `destroy_process_group()` (`Trainer.end()`,
`Accelerator.end_training()`). DeepSpeed keeps them (`deepspeed.utils.groups._WORLD_GROUP`, each ZeRO-3 parameter's
`ds_process_group`), and `ProcessGroup.shutdown()` leaves gloo's worker threads running: 2 groups, 4
`pt_gloo_runloop` threads after `end_training()` in `tests/scripts/opd_zero3_uneven_teachers.py` (2026-12-02). A gloo
thread that needs the GIL while the interpreter shuts down is ended by `pthread_exit`, which C++ turns into
`std::terminate`: "terminate called without an active exception", SIGABRT, after the script's last line (see
`tests/scripts/gloo_exit_abort.py`). torchrun then ends the other rank with SIGTERM and the launch exits 1. CI met it
twice in one run (2026-12-02: rank 0 of a ZeRO-3 test script, and a recipe's worker rank while the main rank was
still writing its results). It is gloo's (the CPU backend): a GPU run's NCCL groups are not affected.
`launch` passes such a launch, with a warning, when every rank finished its script; when a rank that torchrun ended
had not (its work cut short by the other's abort, not by an error of its own), it empties the launch's output folder
and runs it once more, provided that folder held nothing before the launch (it is emptied only if it holds the
launch's outputs only). Any other failure fails the test, and the test's own checks of what each rank wrote decide
the rest.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import warnings
from pathlib import Path

HOOKS = Path(__file__).parent / "launch_hooks"
EXIT_ABORT = "terminate called without an active exception"
FINISHED = "statelens-test: rank {} (pid {}) finished its script"  # as launch_hooks/sitecustomize.py prints it
FINISHED_RANK = re.compile(re.escape(FINISHED).replace(r"\{\}", r"(\d+)"))  # (rank, pid)
# torchrun's failure table: "rank      : 1 (local_rank: 1)" then "exitcode  : -15 (pid: 8709)  (SIGTERM)"
RANK_EXIT = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
SIGABRT, SIGTERM = str(-signal.SIGABRT), str(-signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(env: dict | None = None) -> dict:
    """The environment of a launch: this one, one thread per rank, the rank hooks on, and `env` added."""
    path = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "STATELENS_RANK_HOOKS": "1", **(env or {})}


def shutdown_abort(stderr: str) -> tuple[bool, bool]:
    """Whether the launch failed only because ranks that had finished their script aborted while shutting down (and
    torchrun ended the others), and whether every rank had finished its script by then."""
    table = RANK_EXIT.findall(stderr)
    exits = {rank: code for rank, code, _ in table}
    aborted = {rank for rank, code in exits.items() if code == SIGABRT}
    # a rank's word counts from the process torchrun ran as that rank only (not from a child that printed it)
    ran = {(rank, pid) for rank, _, pid in table}
    finished = {rank for rank, pid in FINISHED_RANK.findall(stderr) if (rank, pid) in ran}
    only_that = (
        EXIT_ABORT in stderr
        and bool(aborted)
        and aborted <= finished
        and all(code in (SIGABRT, SIGTERM) for code in exits.values())
    )
    return only_that, only_that and set(exits) <= finished


def run_ranks(
    command: list[str], env: dict | None, timeout: int, hang: str | None = None
) -> subprocess.CompletedProcess:
    """Run a multi-process `command` with `rank_env(env)`. A run still going after `timeout` s fails the test with
    `hang`, as a deadlock of the ranks' collectives would: the launcher is stopped with SIGTERM, on which torch's
    elastic agent ends the ranks (it starts each in a session of its own, which a kill of the launcher's group would
    leave running), then killed whole after 60 s."""
    import pytest

    run = subprocess.Popen(command, env=rank_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGTERM)
        try:
            stdout, stderr = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            stdout, stderr = run.communicate()
        pytest.fail(f"{hang or f'no exit in {timeout} s'}: {stderr[-2000:]}")
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def before_launch(outputs: Path | None) -> list[str]:
    """What `outputs` holds before a launch (up to 5 names): anything there is not the launch's to empty."""
    if outputs is None or not os.path.lexists(outputs):
        return []
    if outputs.is_symlink() or not outputs.is_dir():
        return [f"{outputs.name} (not a folder)"]
    return sorted(path.name for path in outputs.iterdir())[:5]


def launch(
    command: list[str],
    env: dict | None = None,
    timeout: int = 300,
    hang: str | None = None,
    outputs: Path | None = None,
) -> str:
    """`run_ranks`, asserting that the launch exits 0, and its stdout. A launch that failed only by the abort at
    shutdown the module docstring describes passes with a warning when every rank had finished; otherwise, with
    `outputs` (the folder it writes into, emptied first), it runs once more. `outputs` must hold the launch's outputs
    only: a folder that held anything before the launch (the test's inputs, another run's files) is not emptied, and
    the launch not run again."""
    held = before_launch(outputs)
    for attempt in (1, 2):
        run = run_ranks(command, env, timeout, hang)
        if run.returncode == 0:
            return run.stdout
        only_shutdown_abort, all_finished = shutdown_abort(run.stderr)
        if only_shutdown_abort and all_finished:
            warnings.warn(f"a rank aborted in gloo's shutdown after its script (tests/launching.py): {run.stderr[-1500:]}",
                          stacklevel=2)  # fmt: skip
            return run.stdout
        if not (only_shutdown_abort and outputs is not None and attempt == 1):
            break
        if held:
            raise AssertionError(
                f"a rank's gloo shutdown abort cut another rank short, but {outputs} held {held} before the launch: "
                f"not emptied, not run again (pass a folder of the launch's outputs only): {run.stderr[-4000:]}"
            )
        warnings.warn(
            f"a rank's gloo shutdown abort cut another rank short; run again: {run.stderr[-1500:]}", stacklevel=2
        )
        if outputs.exists():
            shutil.rmtree(outputs)
        outputs.mkdir(parents=True)
    raise AssertionError(run.stderr[-4000:])
