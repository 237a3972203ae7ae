"""A preflight check's result, how results are graded against their thresholds, and what becomes of them: the file
(`<output_dir>/statelens/preflight.json`), the block in the log, and the refusal of `preflight="strict"`."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

PREFLIGHT_MODES = ("warn", "strict", "off")
VERDICTS = ("pass", "warn", "fail", "skipped")
PREFLIGHT_FILE = "preflight.json"


class PreflightFailed(RuntimeError):
    """Raised by `preflight="strict"` when a check fails: its message lists each failing check and its fix."""


@dataclass
class Check:
    """One measured number (`value`, `None` when not measured), its `threshold` in words, its `verdict`
    (:data:`VERDICTS`), and what to do when it is not a pass (`fix`). `details` holds the numbers behind it."""

    name: str
    value: float | None
    threshold: str
    verdict: str
    fix: str = ""
    details: dict = field(default_factory=dict)


def graded(
    name: str,
    value: float | None,
    warn_at: float,
    fail_at: float | None,
    fix: str,
    higher_is_worse: bool = True,
    details: dict | None = None,
    unmeasured: str = "not measured",
) -> Check:
    """A check whose `value` warns at or beyond `warn_at` and fails at or beyond `fail_at` (`None`: never fails); with
    `higher_is_worse=False` the low side is the bad one. A `value` of `None` or NaN is `skipped` (`unmeasured` says
    why)."""
    side = ">=" if higher_is_worse else "<="
    threshold = f"warn {side} {warn_at:g}" + ("" if fail_at is None else f", fail {side} {fail_at:g}")
    if value is None or math.isnan(value):
        return Check(name, None, threshold, "skipped", unmeasured, details or {})

    def beyond(limit):
        return limit is not None and (value >= limit if higher_is_worse else value <= limit)

    verdict = "fail" if beyond(fail_at) else "warn" if beyond(warn_at) else "pass"
    return Check(name, value, threshold, verdict, "" if verdict == "pass" else fix, details or {})


def skipped(name: str, reason: str) -> Check:
    return Check(name, None, "", "skipped", reason)


def overall_verdict(checks: list[Check]) -> str:
    verdicts = {check.verdict for check in checks}
    return "fail" if "fail" in verdicts else "warn" if "warn" in verdicts else "pass"


def summary(trainer_name: str, checks: list[Check], seconds: float, prompts: int) -> dict:
    """What `preflight.json` holds: the verdict, its cost, and every check."""
    return {
        "trainer": trainer_name,
        "verdict": overall_verdict(checks),
        "seconds": round(seconds, 3),
        "prompts": prompts,
        "checks": [_json_safe(asdict(check)) for check in checks],
    }


def write_summary(output_dir: str, result: dict) -> Path:
    folder = Path(output_dir) / "statelens"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / PREFLIGHT_FILE
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    return path


def read_summary(run_dir) -> dict | None:
    """A run folder's `statelens/preflight.json` (also accepted: the `statelens` folder itself), or `None`."""
    for path in (Path(run_dir) / "statelens" / PREFLIGHT_FILE, Path(run_dir) / PREFLIGHT_FILE):
        if path.is_file():
            return json.loads(path.read_text())
    return None


def _shown(value) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def readable_block(result: dict) -> str:
    """The preflight as lines for the log: one per check with its number, threshold, verdict and fix."""
    lines = [
        f"statelens preflight ({result['trainer']}, {result['prompts']} prompts, {result['seconds']:.1f} s): "
        f"{result['verdict'].upper()}"
    ]
    for check in result["checks"]:
        line = f"  [{check['verdict']:>7}] {check['name']} = {_shown(check['value'])}"
        if check["threshold"]:
            line += f" ({check['threshold']})"
        if check["fix"]:
            line += f": {check['fix']}"
        lines.append(line)
    return "\n".join(lines)


def refusal_message(result: dict) -> str:
    failing = [check for check in result["checks"] if check["verdict"] == "fail"]
    listed = "\n".join(f"- {c['name']} = {_shown(c['value'])} ({c['threshold']}): {c['fix']}" for c in failing)
    return (
        f"preflight='strict' refuses to train: {len(failing)} check(s) failed before step 1.\n{listed}\n"
        "Fix them, or run with preflight='warn' to train anyway (preflight='off' skips the checks)."
    )


def _json_safe(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
