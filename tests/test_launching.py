"""What `tests/launching.py` forgives in a multi-process launch: only gloo's abort at shutdown, after the script."""

import subprocess
import sys

import pytest
from launching import FINISHED, launch, rank_env, shutdown_abort

ABORT = "terminate called without an active exception\n"


def torchrun_table(*exits: tuple[int, int, str]) -> str:
    """The failure table torchrun 2.13 prints, for (rank, exit code, signal name) rows."""
    rows = [
        f"  [{i}]:\n    time      : 2026-12-02_16:31:57\n    host      : localhost\n"
        f"    rank      : {rank} (local_rank: {rank})\n    exitcode  : {code} (pid: 870{rank})  ({name})\n"
        for i, (rank, code, name) in enumerate(exits)
    ]
    return "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nFailures:\n" + "".join(rows)


def finished(*ranks: int) -> str:
    return "".join(FINISHED.format(rank) + "\n" for rank in ranks)


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        # CI 2026-12-02, first failure: rank 0 aborted in its shutdown, torchrun ended rank 1
        (finished(0, 1) + ABORT + torchrun_table((1, -15, "SIGTERM"), (0, -6, "SIGABRT")), (True, True)),
        # second failure: a worker aborted while the main rank (ended by torchrun) still worked: run again
        (finished(1) + ABORT + torchrun_table((0, -15, "SIGTERM"), (1, -6, "SIGABRT")), (True, False)),
        # an abort during the run (the rank never finished its script) is a failure
        (finished(1) + ABORT + torchrun_table((0, -6, "SIGABRT"), (1, -15, "SIGTERM")), (False, False)),
        # so is a rank's error, even with another rank's abort
        (finished(0) + ABORT + torchrun_table((0, -6, "SIGABRT"), (1, 1, "<N/A>")), (False, False)),
        # and a SIGABRT that is not this abort
        (finished(0, 1) + torchrun_table((0, -6, "SIGABRT"), (1, -15, "SIGTERM")), (False, False)),
    ],
)
def test_only_the_shutdown_abort_after_the_script_is_forgiven(stderr, expected):
    assert shutdown_abort(stderr) == expected


@pytest.mark.parametrize(("code", "says_finished"), [("pass", True), ("raise SystemError('x')", False)])
def test_a_rank_says_it_finished_its_script_only_without_an_uncaught_exception(code, says_finished):
    done = subprocess.run([sys.executable, "-c", code], env=rank_env({"RANK": "3"}), capture_output=True, text=True)
    assert (FINISHED.format(3) in done.stderr) is says_finished
    assert (done.returncode == 0) is says_finished


def fake_launch(tmp_path, stderr: str):
    """A command that fails as a launch would, with `stderr`, on its first run only, then lists the outputs folder."""
    script = tmp_path / "fake_launch.py"
    runs, outputs = tmp_path / "runs", tmp_path / "outputs"
    script.write_text(
        "import pathlib, sys\n"
        f"runs = pathlib.Path({str(runs)!r})\n"
        "runs.write_text(runs.read_text() + 'x' if runs.exists() else 'x')\n"
        f"if runs.read_text() == 'x':\n    sys.stderr.write({stderr!r})\n    sys.exit(1)\n"
        f"print('outputs:', sorted(p.name for p in pathlib.Path({str(outputs)!r}).iterdir()))\n"
    )
    outputs.mkdir()
    (outputs / "from_the_first_run").write_text("")
    return [sys.executable, str(script)], outputs, runs


def test_a_launch_cut_short_by_the_abort_runs_again_on_fresh_outputs(tmp_path):
    command, outputs, runs = fake_launch(
        tmp_path, finished(1) + ABORT + torchrun_table((0, -15, "SIGTERM"), (1, -6, "SIGABRT"))
    )
    with pytest.warns(UserWarning, match="run again"):
        stdout = launch(command, outputs=outputs)
    assert runs.read_text() == "xx" and "outputs: []" in stdout


def test_a_launch_that_failed_otherwise_is_not_run_again(tmp_path):
    command, outputs, runs = fake_launch(tmp_path, ABORT + torchrun_table((0, -6, "SIGABRT"), (1, -15, "SIGTERM")))
    with pytest.raises(AssertionError, match="SIGABRT"):
        launch(command, outputs=outputs)
    assert runs.read_text() == "x" and (outputs / "from_the_first_run").exists()
