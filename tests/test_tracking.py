"""The `statelens/*` metrics reach real tracking backends: read back from tensorboard's event files and trackio's
local database after a short StateLens run (`tensorboard_opd_run` in conftest.py)."""

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def logged(log_history: list[dict], prefix: str = "statelens/") -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every `prefix` metric the trainer logged, in order."""
    series = {}
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith(prefix):
                series.setdefault(key, []).append((entry["step"], value))
    return series


def test_statelens_metrics_in_tensorboard_event_files(tensorboard_opd_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, log_history = tensorboard_opd_run
    event_files = list((run_dir / "runs").rglob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files
    events = EventAccumulator(str(event_files[0].parent), size_guidance={"scalars": 0})
    events.Reload()
    expected = logged(log_history)
    assert {
        "statelens/state_nll",
        "statelens/offpolicy_gap",
        "statelens/teacher_kl/supervised",
        "statelens/drift/mmd",
    } <= set(expected)
    for key, points in expected.items():
        scalars = events.Scalars(f"train/{key}")  # the trainer's tensorboard callback prefixes train/
        assert [s.step for s in scalars] == [step for step, _ in points], key  # once per logged step
        assert [s.value for s in scalars] == pytest.approx([v for _, v in points], rel=1e-5, abs=1e-6), key
    assert len(expected["statelens/state_nll"]) == 4 and len(expected["statelens/drift/mmd"]) == 2


@pytest.mark.skipif(
    importlib.util.find_spec("trackio") is None, reason="trackio is not installed (pip install trackio)"
)
def test_statelens_metrics_in_trackio_offline(tensorboard_opd_run):
    from trackio.sqlite_storage import SQLiteStorage

    run_dir, log_history = tensorboard_opd_run
    assert (
        SQLiteStorage.get_project_db_path("statelens-tests") == Path(os.environ["TRACKIO_DIR"]) / "statelens-tests.db"
    )
    rows = SQLiteStorage.get_logs("statelens-tests", run_dir.name)
    for key, points in logged(log_history).items():
        stored = [(row["train/global_step"], row[f"train/{key}"]) for row in rows if f"train/{key}" in row]
        assert [step for step, _ in stored] == [step for step, _ in points], key
        assert [v for _, v in stored] == pytest.approx([v for _, v in points], rel=1e-6), key
