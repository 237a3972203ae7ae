"""The package as users install it: build the wheel and sdist, install the wheel into a fresh virtual environment
(no editable install, this checkout not on the path) and run it.

The build runs with `--no-isolation` (the setuptools of the running environment): an isolated build would download
setuptools, and the tests run offline. The fresh environment gets the dependencies through a `.pth` line naming this
environment's site-packages, which only adds that folder to `sys.path` (its own `.pth` files, such as an editable
install's finder, are not run), so `trl_statelens` can only come from the wheel.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import trl_statelens

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[1]
SOURCES = ["LICENSE", "pyproject.toml", "README.md", "trl_statelens"]


def run(args, **kwargs):
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The wheel and sdist built from a copy of the sources (the checkout stays clean)."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--wheel", "--sdist", "--no-isolation", "--outdir", str(out), str(source)])
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def test_wheel_metadata_is_what_a_package_index_shows(dist):
    wheel, sdist = dist
    assert wheel.name == f"trl_statelens-{trl_statelens.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = Parser().parsestr(
            archive.read(f"trl_statelens-{trl_statelens.__version__}.dist-info/METADATA").decode()
        )
        entry_points = archive.read(f"trl_statelens-{trl_statelens.__version__}.dist-info/entry_points.txt").decode()
    assert {"trl_statelens/reports/states_page.py", "trl_statelens/lab/paths.py", "trl_statelens/cli.py"} <= set(names)
    assert "trl_statelens/lens/forgetting_calibration.json" in names  # ForgettingForecast's default calibration
    assert "trl_statelens/reports/states_page.js" in names  # the states page's script
    assert not any(name.startswith(("tests/", "recipes/", "bench/")) for name in names)
    assert metadata["Name"] == "trl-statelens" and metadata["Version"] == trl_statelens.__version__
    assert metadata["License-Expression"] == "Apache-2.0" and metadata["Requires-Python"] == ">=3.10"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert f"trl_statelens-{trl_statelens.__version__}.dist-info/licenses/LICENSE" in names
    assert metadata["Summary"] and metadata["Keywords"]
    assert "Programming Language :: Python :: 3.11" in metadata.get_all("Classifier")
    assert {"plots", "peft", "deepspeed", "vllm", "math", "tracking", "dev"} <= set(metadata.get_all("Provides-Extra"))
    assert any(r.startswith("trl<1.17,>=1.16.0") for r in metadata.get_all("Requires-Dist"))
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().startswith("# trl-statelens")  # the README is the project page
    assert "statelens = trl_statelens.cli:main" in entry_points
    with tarfile.open(sdist) as archive:
        members = {Path(*Path(name).parts[1:]).as_posix() for name in archive.getnames()}
    assert {"pyproject.toml", "README.md", "trl_statelens/reports/states_page.js", "PKG-INFO"} <= members


def test_installed_wheel_imports_and_runs(dist, tmp_path):
    wheel, _ = dist
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)])
    site_packages = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    home = tmp_path / "home"
    (home / "lab" / "v2" / "seed0").mkdir(parents=True)
    info = {"size": "test", "parameters": 1e5, "pretrain_steps": 5, "build_seconds": 3.0, "in_band": False}
    info["test_scores"] = {"math": 0.1, "kb": 0.5, "truth": 0.5}
    (home / "lab" / "v2" / "seed0" / "info.json").write_text(json.dumps(info))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "STATELENS_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env |= {key: os.environ[key] for key in ("TMPDIR",) if key in os.environ}  # no PYTHONPATH: nothing from here

    imported = run(
        [str(python), "-c", "import trl_statelens as t; print(t.__file__); print(t.StateLensSFTTrainer.__module__)"],
        cwd=tmp_path,
        env=env,
    ).split()
    assert Path(imported[0]).is_relative_to(site_packages), imported  # the wheel's copy, not this checkout
    assert imported[1] == "trl_statelens.trainers.sft"
    statelens = str(venv / "bin" / "statelens")
    assert "{lab,eval,report,preflight,guards}" in run([statelens, "--help"], cwd=tmp_path, env=env)
    assert "math 0.100  kb (MMLU analog) 0.500" in run([statelens, "lab", "info"], cwd=tmp_path, env=env)
