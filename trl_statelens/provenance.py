"""What a run ran with: the package's code, the library versions and a hash of each model's weights.

Two reruns of the same config can differ in the last bits (a rebuilt base model, a newer transformers) and so in
every score; nothing else in a run folder says so. :func:`provenance` returns the record, written at the start of
training into the ledger (`statelens/provenance.json`, :func:`write_run_provenance`) and into every results and
evaluation file; :func:`provenance_differences` lists what differs between runs (`statelens report` warns with it).

The record::

    {"format": 1, "written_at": "2026-12-05T10:00:00+00:00", "step": 0,
     "code": {"package": "trl-statelens", "version": "0.1.0", "path": ".../trl_statelens",
              "commit": "d2cee35...", "dirty": true, "changes": ["M trl_statelens/lens/callback.py", ...],
              "changes_sha256": "..."},
     "versions": {"python": "3.11.9", "torch": "2.9.0", "cuda": "12.8", "transformers": "5.25.0", "trl": "1.16.0",
                  "accelerate": "1.16.0", "peft": "0.17.1", "deepspeed": null},
     "models": {"student": {"name": "~/.cache/trl_statelens/lab/v2/seed0/base", "sha256": "...",
                            "method": "state_dict", "dtypes": ["float32"], "seconds": 0.01}}}

- `code`: `commit` and `dirty` (uncommitted changes or untracked files) of the git checkout the package runs from,
  `changes` its `git status --porcelain` lines (at most 200) and `changes_sha256` a hash of those changes' contents
  (`git diff HEAD` and the untracked files), so two dirty trees with different edits differ; all `None` when the
  package is not a git checkout (an installed wheel: then `version` says which).
- `versions`: from `importlib.metadata` (`None` for a library not installed); `cuda` is torch's CUDA build.
- `models`: by role (`student`, `teacher` or `teacher/<name>`, `ref_model`): the model's `name` (the folder, with the
  home directory as `~`, or hub id it was loaded from) and `sha256`, by `method` `"state_dict"` (each state dict
  tensor's name, dtype, shape and the sha256 of its bytes, in name order, on CPU; a tied tensor once) or, for a model
  whose parameters are sharded across processes (ZeRO-3, FSDP), `"safetensors files"` (the `*.safetensors` files of
  the folder it was loaded from); `None` with a `method` saying why when neither applies (a served teacher, a sharded
  model from a hub id). A model that is another role's (a self teacher reading the student) is `{"same_as": role}`.

Nothing here imports from the rest of the package: the lens, the reports and the evaluation use it.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROVENANCE_FILE = "provenance.json"  # in the ledger folder, `<output_dir>/statelens/`
FORMAT = 1
LIBRARIES = ("torch", "transformers", "trl", "accelerate", "peft", "deepspeed")
PACKAGE = "trl-statelens"
MAX_CHANGES = 200  # `git status --porcelain` lines kept in the record
MAX_UNTRACKED_BYTES = 64 * 2**20  # untracked files read for `changes_sha256`; past this, by name and size only
GIT_TIMEOUT_S = 20


# ----- the record ---------------------------------------------------------------------------------------------------
def provenance(models: dict | None = None, step: int = 0) -> dict:
    """The provenance record (module docstring) of this process, with a hash of each of `models`' weights.

    Args:
        models: `{role: model}`: a `torch.nn.Module` (a DDP / DeepSpeed wrapper is unwrapped), or a folder or hub id
            (its `*.safetensors` files are hashed; a hub id is named only), or `None` (left out).
        step: the optimizer step the record is written at (0 at the start of a run; a resumed run's step).
    """
    return {
        "format": FORMAT,
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": step,
        "code": code_provenance(),
        "versions": library_versions(),
        "models": model_hashes(models or {}),
    }


def library_versions() -> dict[str, str | None]:
    """Python's version, torch's CUDA build and the installed version of each of `LIBRARIES` (`None`: absent)."""
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        versions[name] = _version(name)
        if name == "torch":
            torch = sys.modules.get("torch")  # imported already wherever there is a model to hash
            versions["cuda"] = getattr(getattr(torch, "version", None), "cuda", None) if torch else None
    return versions


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def code_provenance(package_dir: str | Path | None = None) -> dict:
    """The package's version and, when it runs from a git checkout, the checkout's commit and uncommitted changes."""
    package_dir = Path(package_dir or Path(__file__).parent).resolve()
    record = {
        "package": PACKAGE,
        "version": _version(PACKAGE),
        "path": str(package_dir),
        "commit": None,
        "dirty": None,
        "changes": None,
        "changes_sha256": None,
    }
    top = _git(package_dir, "rev-parse", "--show-toplevel")
    # a package installed inside some other checkout (a venv in a repository) is not that checkout's code
    if top is None or _git(package_dir, "ls-files", "--error-unmatch", "--", "__init__.py") is None:
        return record
    top = Path(top.decode().strip())
    commit, status = _git(top, "rev-parse", "HEAD"), _git(top, "status", "--porcelain")
    if commit is None or status is None:
        return record
    changes = status.decode(errors="replace").splitlines()
    record.update(
        commit=commit.decode().strip(),
        dirty=bool(changes),
        changes=changes[:MAX_CHANGES],
        changes_sha256=_changes_digest(top) if changes else None,
    )
    return record


def _git(where: Path, *args: str) -> bytes | None:
    """`git -C where args` stdout, `None` when git is missing or the command fails (not a checkout)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _changes_digest(top: Path) -> str | None:
    """sha256 of the checkout's uncommitted changes: `git diff HEAD` and each untracked, not ignored file."""
    diff = _git(top, "diff", "HEAD", "--binary")
    untracked = _git(top, "ls-files", "--others", "--exclude-standard", "-z")
    if diff is None or untracked is None:
        return None
    digest, budget = hashlib.sha256(diff), MAX_UNTRACKED_BYTES
    for name in sorted(n for n in untracked.decode(errors="replace").split("\0") if n):
        path = top / name
        digest.update(b"\0untracked\0" + name.encode() + b"\0")
        try:
            size = path.stat().st_size
            read = size <= budget  # run outputs left in the tree must not make every start slow
            digest.update(path.read_bytes() if read else f"{size} bytes".encode())
            budget -= size if read else 0
        except OSError:
            digest.update(b"unreadable")
    return digest.hexdigest()


# ----- weights ------------------------------------------------------------------------------------------------------
def model_hashes(models: dict) -> dict[str, dict]:
    """`{role: weights record}` (module docstring); a model met before under another role is `{"same_as": role}`."""
    records, seen = {}, {}
    for role, model in models.items():
        if model is None:
            continue
        if not isinstance(model, (str, Path)):
            model = getattr(model, "module", model)  # DDP / DeepSpeed engine
            if id(model) in seen:
                records[role] = {"same_as": seen[id(model)]}
                continue
            seen[id(model)] = role
        records[role] = weights_hash(model)
    return records


def weights_hash(model) -> dict:
    """The weights record of a model, or of a folder or hub id (module docstring)."""
    started = time.perf_counter()
    if isinstance(model, (str, Path)):
        name, record = str(model), files_hash(model)
    else:
        model = getattr(model, "module", model)
        name = model_name(model)
        if is_sharded(model):
            record = files_hash(name) if name else {"sha256": None}
            if record["sha256"] is None:  # the files are the starting weights only when loaded from a folder
                record = {"sha256": None, "method": "not hashed: parameters sharded across processes, no local folder"}
        else:
            record = state_dict_hash(model)
    return {"name": _portable(name), **record, "seconds": round(time.perf_counter() - started, 3)}


def _portable(name: str) -> str:
    """A folder under the home directory as `~/...`, so the same lab model on two machines has the same name."""
    home = str(Path.home())
    return "~" + name[len(home) :] if home not in ("", "/") and name.startswith(home + "/") else name


def model_name(model) -> str:
    """The folder or hub id a model was loaded from (`config._name_or_path`; `""` for one built from a config)."""
    return str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")


def is_sharded(model) -> bool:
    """Whether this process holds only part of the model's parameters (ZeRO-3, FSDP's DTensors, meta tensors)."""
    return any(
        hasattr(p, "ds_id") or type(p).__name__ == "DTensor" or p.device.type == "meta" for p in model.parameters()
    )


def state_dict_hash(model, workers: int | None = None) -> dict:
    """sha256 over the state dict in name order: each tensor's name, dtype, shape and the sha256 of its bytes (on CPU;
    `workers` threads hash tensors side by side, at most that many copies on CPU at once); a tensor that is another's
    storage (tied weights) enters as a reference to the first name."""
    import torch

    entries, first_name, dtypes = [], {}, set()  # (header, tensor to hash or the name it repeats)
    for name, tensor in sorted(model.state_dict().items()):
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = tensor.detach()
        header = f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0"
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in first_name:
            entries.append((header, f"={first_name[key]}"))
            continue
        first_name[key] = name
        dtypes.add(str(tensor.dtype).removeprefix("torch."))
        entries.append((header, tensor))
    workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:  # the copies and hashlib release the GIL
        digests = pool.map(lambda entry: entry[1] if isinstance(entry[1], str) else _tensor_sha256(entry[1]), entries)
        digest = hashlib.sha256()
        for (header, _), tensor_digest in zip(entries, digests):
            digest.update((header + tensor_digest).encode())
    return {"sha256": digest.hexdigest(), "method": "state_dict", "dtypes": sorted(dtypes)}


def _tensor_sha256(tensor) -> str:
    import torch

    flat = tensor.to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy() if flat.numel() else b"").hexdigest()


def files_hash(folder: str | Path) -> dict:
    """sha256 over the `*.safetensors` files of a local folder (each file's name and sha256, in name order)."""
    folder = Path(folder).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        why = "no *.safetensors files in the folder" if folder.is_dir() else "not a local folder (a hub id?)"
        return {"sha256": None, "method": f"not hashed: {why}"}
    digest = hashlib.sha256()
    for path in files:
        file_digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(2**24), b""):
                file_digest.update(chunk)
        digest.update(f"{path.name}\0{file_digest.hexdigest()}\0".encode())
    return {"sha256": digest.hexdigest(), "method": "safetensors files", "files": [path.name for path in files]}


# ----- a trainer's run ----------------------------------------------------------------------------------------------
def trainer_models(trainer) -> dict:
    """A trainer's models by role: `student`, its teachers (`teacher`, or `teacher/<name>` with several; a served
    teacher by the name it was given) and a `ref_model`."""
    models = {"student": trainer.model}
    teacher = getattr(trainer, "teacher", None)  # OnPolicyDistillTrainer's Teacher (or TeacherRouter)
    if teacher is not None and hasattr(teacher, "reads_own_prompts"):
        teachers = getattr(teacher, "teachers", None) or {"": teacher}
        served = getattr(trainer.args, "teacher_model_name_or_path", None) or "served"
        for name, one in teachers.items():
            role = f"teacher/{name}" if name else "teacher"
            models[role] = one.model if one.model is not None else _Served(served)
    elif getattr(trainer, "teacher_model", None) is not None:  # TRL's DistillationTrainer, SDFTTrainer, ...
        models["teacher"] = trainer.teacher_model
    elif getattr(trainer.args, "teacher_model_server_url", None):
        models["teacher"] = _Served(trainer.args.teacher_model_server_url)
    if getattr(trainer, "ref_model", None) is not None:
        models["ref_model"] = trainer.ref_model
    return models


class _Served:
    """A teacher on a server: named, its weights not in this process."""

    def __init__(self, name: str):
        self.name = name


def write_run_provenance(ledger_dir: str | Path, trainer, step: int = 0) -> dict:
    """Write `ledger_dir/provenance.json` at the start of a run (main process only: no collective).

    A fresh run (`step` 0) writes its record; a run resumed at `step` keeps the start's record and appends its own to
    its `resumed` list (its models' hashes are then the checkpoint's weights)."""
    models = trainer_models(trainer)
    served = {role: model for role, model in models.items() if isinstance(model, _Served)}
    record = provenance({role: m for role, m in models.items() if role not in served}, step=step)
    for role, model in served.items():
        record["models"][role] = {"name": model.name, "sha256": None, "method": "not hashed: a served teacher"}
    path = Path(ledger_dir) / PROVENANCE_FILE
    if step > 0 and path.is_file():
        try:
            start = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            start = None
        if isinstance(start, dict):
            start.setdefault("resumed", []).append(record)
            record = start
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2), encoding="utf-8")
    return record


def read_run_provenance(run_dir: str | Path) -> dict | None:
    """A run folder's provenance: its ledger's `statelens/provenance.json`, else its `results.json`'s `provenance`."""
    run_dir = Path(run_dir)
    for path, key in ((run_dir / "statelens" / PROVENANCE_FILE, None), (run_dir / "results.json", "provenance")):
        if path.is_file():
            try:
                found = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            found = found.get(key) if key and isinstance(found, dict) else found
            if isinstance(found, dict):
                return found
    return None


# ----- comparing runs -----------------------------------------------------------------------------------------------
def fingerprint(record: dict, with_models: bool = True) -> dict[str, str | None]:
    """What two runs must share to compare like with like, as `{what: value}`: the package's commit, dirty flag,
    changes and version, each library's version and, keyed by model name and hash method, each model's starting
    hash (not a record written at a resume, whose hashes are the checkpoint's)."""
    code = record.get("code") or {}
    found = {
        "package commit": code.get("commit"),
        "uncommitted changes": None if code.get("dirty") is None else ("yes" if code["dirty"] else "none"),
        "package version": code.get("version"),
    }
    if code.get("dirty"):
        found["uncommitted changes (sha256)"] = code.get("changes_sha256")
    for name, version in (record.get("versions") or {}).items():
        found[name] = version if version is not None else "not installed"
    if with_models and not record.get("step"):  # a record written at a resume hashed the checkpoint's weights
        for model in (record.get("models") or {}).values():
            if isinstance(model, dict) and model.get("sha256") and model.get("name"):
                found[f"weights of {model['name']} ({model.get('method')} sha256)"] = model["sha256"]
    return found


def provenance_differences(records: dict[str, dict | None]) -> list[tuple[str, dict[str, str | None]]]:
    """What differs between runs' provenance records (`{label: record}`), as `[(what, {label: value})]`.

    Compared: the package's commit, dirty flag (and, between dirty trees, their changes), version; every library
    version; and the weights hash of each model by name, between the runs that have a model of that name hashed the
    same way (runs may train different models on purpose). A run resumed in another environment than it started in
    enters as a further label, `"<label> (resumed at step N)"`, with its code and versions. Runs without a record are
    left out (:func:`runs_without_provenance`). Empty when they agree."""
    prints = {}
    for label, record in records.items():
        if not isinstance(record, dict):
            continue
        prints[label] = fingerprint(record)
        for resumed in record.get("resumed") or []:
            if isinstance(resumed, dict):
                again = fingerprint(resumed, with_models=False)
                if any(again.get(key) != value for key, value in prints[label].items() if key in again):
                    prints[f"{label} (resumed at step {resumed.get('step')})"] = again
    whats = list(dict.fromkeys(what for found in prints.values() for what in found))
    differences = []
    for what in whats:
        values = {label: found[what] for label, found in prints.items() if what in found}
        if len(set(values.values())) > 1:  # a model: between the runs with it; the rest: every run records them
            differences.append((what, values))
    return differences


def runs_without_provenance(records: dict[str, dict | None]) -> list[str]:
    """The labels of runs with no record, when others have one (nothing to say when none has)."""
    missing = [label for label, record in records.items() if not isinstance(record, dict)]
    return missing if len(missing) < len(records) else []


def short(value: str | None) -> str:
    """A value for a warning: a hash shortened to 12 characters, `None` as `unknown`."""
    if value is None:
        return "unknown"
    return value[:12] if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else value


def differences_text(differences: list[tuple[str, dict[str, str | None]]]) -> list[str]:
    """One line per difference: `what: value (label, label); value (label)`."""
    lines = []
    for what, values in differences:
        by_value: dict[str | None, list[str]] = {}
        for label, value in values.items():
            by_value.setdefault(value, []).append(label)
        lines.append(f"{what}: " + "; ".join(f"{short(v)} ({', '.join(labels)})" for v, labels in by_value.items()))
    return lines
