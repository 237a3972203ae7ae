"""What `tests/launching.py` forgives in a multi-process launch: only gloo's abort at shutdown, after the script."""

import subprocess
import sys

import pytest
from launching import FINISHED, FINISHED_RANK, launch, rank_env, shutdown_abort

ABORT = "terminate called without an active exception\n"


def torchrun_table(*exits: tuple[int, int, str]) -> str:
    """The failure table torchrun 2.13 prints, for (rank, exit code, signal name) rows."""
    rows = [
        f"  [{i}]:\n    time      : 2026-12-02_16:31:57\n    host      : localhost\n"
        f"    rank      : {rank} (local_rank: {rank})\n    exitcode  : {code} (pid: 870{rank})  ({name})\n"
        for i, (rank, code, name) in enumerate(exits)
    ]
    return "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nFailures:\n" + "".join(rows)


def finished(*ranks: int, pid: str = "870{}") -> str:
    """The ranks' word that they finished their script, from the pids `torchrun_table` gives them."""
    return "".join(FINISHED.format(rank, pid.format(rank)) + "\n" for rank in ranks)


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
        # a rank's word from another process (a child of the rank, given the hook's environment) does not count
        (
            finished(0, pid="971{}") + finished(1) + ABORT + torchrun_table((0, -6, "SIGABRT"), (1, -15, "SIGTERM")),
            (False, False),
        ),
    ],
)
def test_only_the_shutdown_abort_after_the_script_is_forgiven(stderr, expected):
    assert shutdown_abort(stderr) == expected


ARGPARSE = "import argparse; p = argparse.ArgumentParser(); p.add_argument('--n', type=int); p.parse_args({})"


@pytest.mark.parametrize(
    ("code", "says_finished"),
    [
        ("pass", True),
        ("raise SystemError('x')", False),
        ("import sys; sys.exit(0)", True),
        ("import sys\ndef main():\n    return 0\nif __name__ == '__main__':\n    sys.exit(main())", True),
        ("import sys\ntry:\n    sys.exit(2)\nexcept SystemExit:\n    pass", True),  # caught: the script went on
        (ARGPARSE.format("['--n', '1']"), True),
        ("import sys; sys.exit(1)", False),
        ("raise SystemExit(1)", False),
        (ARGPARSE.format("['--n', 'x']"), False),  # argparse's error: exit status 2
    ],
)  # fmt: skip
def test_a_rank_says_it_finished_its_script_only_if_it_ran_to_its_end(code, says_finished):
    run = subprocess.Popen(
        [sys.executable, "-c", code], env=rank_env({"RANK": "3"}), stderr=subprocess.PIPE, text=True
    )
    stderr = run.communicate()[1]
    assert FINISHED_RANK.findall(stderr) == ([("3", str(run.pid))] if says_finished else [])
    assert (run.returncode == 0) is says_finished


def fake_launch(tmp_path, stderr: str):
    """A command that fails as a launch would, with `stderr`, on its first run only (after writing into the outputs
    folder), then lists the outputs folder."""
    script = tmp_path / "fake_launch.py"
    runs, outputs = tmp_path / "runs", tmp_path / "outputs"
    script.write_text(
        "import pathlib, sys\n"
        f"runs, outputs = pathlib.Path({str(runs)!r}), pathlib.Path({str(outputs)!r})\n"
        "runs.write_text(runs.read_text() + 'x' if runs.exists() else 'x')\n"
        "if runs.read_text() == 'x':\n"
        "    outputs.mkdir(exist_ok=True)\n"
        "    (outputs / 'from_the_first_run').write_text('')\n"
        f"    sys.stderr.write({stderr!r})\n"
        "    sys.exit(1)\n"
        "print('outputs:', sorted(p.name for p in outputs.iterdir()))\n"
    )
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


def test_a_folder_that_held_anything_before_the_launch_is_not_emptied_for_a_rerun(tmp_path):
    command, outputs, runs = fake_launch(
        tmp_path, finished(1) + ABORT + torchrun_table((0, -15, "SIGTERM"), (1, -6, "SIGABRT"))
    )
    outputs.mkdir()
    (outputs / "the_tests_input").write_text("")
    with pytest.raises(AssertionError, match=r"held \['the_tests_input'\] before the launch: not emptied"):
        launch(command, outputs=outputs)
    assert runs.read_text() == "x"
    assert sorted(p.name for p in outputs.iterdir()) == ["from_the_first_run", "the_tests_input"]


# ----- the review of 2026-12-04, Part 2 finding 5: two ways a rank that did not finish its script said it did -------
def failed_rank(code: str) -> tuple[str, int]:
    """The stderr and pid of a rank 0 whose script `code` failed."""
    run = subprocess.Popen(
        [sys.executable, "-c", code], env=rank_env({"RANK": "0"}), stderr=subprocess.PIPE, text=True
    )
    stderr = run.communicate()[1]
    assert run.returncode != 0  # the rank's script failed
    return stderr, run.pid


def test_a_rank_that_failed_by_system_exit_is_not_forgiven():
    failed, pid = failed_rank("import sys; sys.exit('rank 0: the ledger is wrong')")
    assert "rank 0: the ledger is wrong" in failed
    assert not FINISHED_RANK.findall(failed)  # the hook does not call a failed script finished
    # the same failure, whose exit gloo's shutdown abort turned into SIGABRT; torchrun then ended rank 1 (which had
    # finished); the table gives rank 0 its real pid, so only the hook's silence keeps the launch failed
    stderr = failed + finished(1) + ABORT + torchrun_table((0, -6, "SIGABRT"), (1, -15, "SIGTERM"))
    stderr = stderr.replace("(pid: 8700)", f"(pid: {pid})")
    assert shutdown_abort(stderr) == (False, False), "a rank that failed via SystemExit is forgiven"


def test_a_rank_that_crashed_after_running_a_python_child_is_not_forgiven():
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass']); raise RuntimeError('real crash')"
    crashed, pid = failed_rank(code)
    assert "RuntimeError: real crash" in crashed
    assert not FINISHED_RANK.findall(crashed)  # the child ran without the rank's hook: it said nothing
    stderr = crashed + finished(1) + ABORT + torchrun_table((0, -6, "SIGABRT"), (1, -15, "SIGTERM"))
    stderr = stderr.replace("(pid: 8700)", f"(pid: {pid})")
    assert shutdown_abort(stderr) == (False, False), "a rank that crashed is forgiven"
