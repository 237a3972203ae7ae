"""`states.html`: what it embeds (Python), and what it shows in a real headless Chromium (WebDriver over HTTP).

The browser tests drive Debian's `chromium` through `chromedriver` with plain W3C WebDriver calls (urllib, no
selenium): open the page from disk, count what it renders, click a filter, read the browser console.
"""

import base64
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from trl_statelens.reports.pages import write_report
from trl_statelens.reports.run_folders import load_run
from trl_statelens.reports.states_data import MAX_SEQUENCES, page_data
from trl_statelens.reports.states_page import write_states_page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1100",
]
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no chromium/chromedriver on PATH: `apt-get install chromium chromium-driver` (`.ci/run` does)",
)


# ----- a minimal WebDriver client -----------------------------------------------------------------------------------
class Browser:
    """One headless Chromium session through chromedriver's W3C WebDriver HTTP API."""

    def __init__(self, user_data_dir: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.driver = subprocess.Popen(
            [CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if self._call("GET", "/status")["ready"]:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.driver.kill()
                raise RuntimeError("chromedriver did not start within 30 s")
            time.sleep(0.1)
        options = {"binary": CHROMIUM, "args": [*CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}"]}
        capabilities = {
            "browserName": "chrome",
            "goog:chromeOptions": options,
            "goog:loggingPrefs": {"browser": "ALL"},
        }
        session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": capabilities}})
        self.session = f"/session/{session['sessionId']}"

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"WebDriver {method} {path}: {err.read().decode()[:500]}") from None

    def open(self, path: Path, fragment: str = "") -> None:
        self._call("POST", f"{self.session}/url", {"url": path.resolve().as_uri() + fragment})
        self.wait_for("document.body.dataset.ready === '1'")

    def run(self, script: str, *args):
        return self._call("POST", f"{self.session}/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, condition: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.run(f"return Boolean({condition})"):
            if time.monotonic() > deadline:
                raise AssertionError(f"page never satisfied {condition}")
            time.sleep(0.05)

    def click(self, css: str) -> None:
        element = self._call("POST", f"{self.session}/element", {"using": "css selector", "value": css})
        self._call("POST", f"{self.session}/element/{element[ELEMENT]}/click", {})

    def hover(self, css: str) -> None:
        element = self._call("POST", f"{self.session}/element", {"using": "css selector", "value": css})
        move = {"type": "pointerMove", "duration": 0, "origin": {ELEMENT: element[ELEMENT]}, "x": 0, "y": 0}
        self._call(
            "POST", f"{self.session}/actions", {"actions": [{"type": "pointer", "id": "mouse", "actions": [move]}]}
        )

    def console(self) -> list[dict]:
        """Browser console entries since the last call (chromedriver's log extension)."""
        return self._call("POST", f"{self.session}/se/log", {"type": "browser"})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", f"{self.session}/screenshot")))

    def close(self) -> None:
        try:
            self._call("DELETE", self.session)
        finally:
            self.driver.terminate()
            self.driver.wait(timeout=30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    browser = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.close()


# ----- pages to look at ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, tensorboard_opd_run):
    """`write_report` on the real OPD run and on a second folder holding part of its ledger (two runs to filter)."""
    run_dir, _ = tensorboard_opd_run
    other = tmp_path_factory.mktemp("other_run")
    (other / "statelens").mkdir()
    lines = (run_dir / "statelens" / "states.jsonl").read_text().splitlines()
    (other / "statelens" / "states.jsonl").write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    shutil.copy(run_dir / "statelens" / "steps.jsonl", other / "statelens" / "steps.jsonl")
    out = tmp_path_factory.mktemp("report")
    write_report([run_dir, other], out)
    return out


def synthetic_ledger(
    run_dir: Path, num_sequences: int, num_steps: int, tokens: int = 120, seed: int = 0, teachers: tuple = ()
) -> None:
    """A ledger of `num_sequences` sequences over `num_steps` steps, in the callback's format; with `teachers`, each
    sequence's `teacher` cycles through them (a run of several teachers)."""
    rng = np.random.default_rng(seed)
    ledger = run_dir / "statelens"
    ledger.mkdir(parents=True)
    per_step = num_sequences // num_steps
    with (ledger / "states.jsonl").open("w") as file:
        for index in range(num_sequences):
            logp = -rng.gamma(1.0, 1.5, tokens)
            teacher = logp - rng.normal(0.3, 0.5, tokens)
            source = ("learner", "dataset")[index % 2]
            line = {
                "step": index // per_step + 1,
                "rank": 0,
                "sequence": index % per_step,
                "source": source,
                "prompt": f"Question: problem {index}?\nAnswer:",
                "completion": "".join(f" w{i}" for i in range(tokens)),
                "reward": float(index % 3 == 0),
                "num_supervised": tokens,
                "tokens": [f" w{i}" for i in range(tokens)],
                "prefix_len": list(range(tokens)),
                "logp": logp.tolist(),
                "entropy": rng.uniform(0.5, 3.0, tokens).tolist(),
                "teacher_logp": teacher.tolist(),
                "weight": [float(rng.normal())] * tokens,
            }
            if teachers:
                line["teacher"] = teachers[index % len(teachers)]
            file.write(json.dumps(line) + "\n")
    with (ledger / "steps.jsonl").open("w") as file:
        for step in range(1, num_steps + 1):
            hist = rng.integers(0, 500, 8).tolist()
            file.write(json.dumps({"step": step, "state_nll": 1.5 + rng.normal(), "prefix_len_hist": hist}) + "\n")


# ----- what the page embeds -----------------------------------------------------------------------------------------
def test_page_embeds_the_ledger_as_recorded(report_dir, tensorboard_opd_run):
    run_dir, _ = tensorboard_opd_run
    page = (report_dir / "states.html").read_text()
    assert "states.html" in (report_dir / "report.md").read_text()
    # self-contained: no external script, style, image or font
    for external in ("<script src", "<link", 'src="http', "url(http", "@import"):
        assert external not in page
    ledger = [json.loads(line) for line in (run_dir / "statelens" / "states.jsonl").read_text().splitlines()]
    data = page_data([load_run(run_dir)])
    assert len(data["sequences"]) == len(ledger) == 4 * 8  # sample_rate=1: every sequence of 4 steps
    assert {line["source"] for line in ledger} == {"learner", "dataset"}
    for line, entry in zip(ledger, data["sequences"]):
        # per-token text as the model saw it: the supervised tokens decoded one by one spell the completion
        assert len(entry["t"]) == line["num_supervised"] == len(entry["lp"])
        if "\ufffd" not in "".join(line["tokens"]):  # a character split over tokens decodes only whole
            assert "".join(line["tokens"]) == line["completion"]
        np.testing.assert_allclose(entry["lp"], line["logp"], atol=5e-4)
        expected_gap = np.mean(-np.asarray(line["logp"]) - np.asarray(line["entropy"]))
        assert entry["gap"] == pytest.approx(expected_gap, abs=1e-6)
        if line["source"] == "learner":
            kl = np.mean(np.asarray(line["logp"]) - np.asarray(line["teacher_logp"]))
            assert entry["kl"] == pytest.approx(kl, abs=1e-6)
        else:
            assert entry["kl"] is None  # dataset tokens: log p_S - log p_T is no KL estimate


@pytest.fixture(scope="module")
def big_page(tmp_path_factory):
    """A 10,000-sequence ledger over 500 steps, and its page."""
    run_dir = tmp_path_factory.mktemp("big") / "run"
    synthetic_ledger(run_dir, num_sequences=10_000, num_steps=500)
    started = time.perf_counter()
    path = write_states_page([load_run(run_dir)], run_dir.parent / "states.html")
    print(f"10k-sequence ledger: page written in {time.perf_counter() - started:.2f} s")
    return run_dir, path


def test_big_ledger_is_sampled_evenly(big_page):
    run_dir, path = big_page
    data = page_data([load_run(run_dir)])
    steps = [entry["s"] for entry in data["sequences"]]
    assert len(steps) == MAX_SEQUENCES and data["runs"][0]["ledger_sequences"] == 10_000
    assert min(steps) == 1 and max(steps) == 500 and len(set(steps)) == 500  # every step keeps some sequences
    size_mb = path.stat().st_size / 1e6
    assert size_mb < 20
    print(f"10k-sequence ledger: page of {size_mb:.1f} MB")


def test_bad_ledger_lines_are_counted_not_fatal(tmp_path):
    synthetic_ledger(tmp_path / "run", num_sequences=20, num_steps=2, tokens=5)
    ledger = tmp_path / "run" / "statelens" / "states.jsonl"
    ledger.write_text(ledger.read_text() + '{"step": 3, "logp": [\n{"step": 3, "logp": []}\n')
    data = page_data([load_run(tmp_path / "run")])
    assert len(data["sequences"]) == 20
    assert data["runs"][0]["notes"] == ["2 ledger line(s) left out: not valid JSON or no per-token values"]


def test_ledger_from_before_per_token_text_shows_the_completion(tmp_path):
    synthetic_ledger(tmp_path / "run", num_sequences=4, num_steps=2, tokens=5)
    ledger = tmp_path / "run" / "statelens" / "states.jsonl"
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    ledger.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "tokens"}) + "\n" for line in lines))
    entries = page_data([load_run(tmp_path / "run")])["sequences"]
    assert [(entry["t"], entry["c"]) for entry in entries] == [(None, line["completion"]) for line in lines]


def test_page_embeds_each_sequences_teacher(tmp_path):
    synthetic_ledger(tmp_path / "two", num_sequences=6, num_steps=2, tokens=3, teachers=("math", "kb", "math"))
    synthetic_ledger(tmp_path / "one", num_sequences=2, num_steps=1, tokens=3)
    data = page_data([load_run(tmp_path / "two"), load_run(tmp_path / "one")])
    assert data["teachers"] == ["kb", "math"]
    assert [entry["te"] for entry in data["sequences"]] == ["math", "kb", "math"] * 2 + [None, None]
    assert page_data([load_run(tmp_path / "one")])["teachers"] == []  # the page offers no teacher filter then


def test_page_shows_the_guard_firings(tmp_path):
    """Beside the preflight's table, the guards' firings of each run that recorded them (`guards.jsonl`), as the
    report shows them; `no guard fired` for a run whose guards stayed quiet, no table when no run has the file."""
    for name in ("fired", "quiet", "unwatched"):
        synthetic_ledger(tmp_path / name, num_sequences=2, num_steps=2, tokens=3)
    firing = {"step": 7, "guard": "loop", "metric": "statelens/ends/repeats", "value": 0.5, "reference": 0.0,
              "threshold": 0.25, "message": "repeats rose <0.25 -> 0.5>", "action": "warn"}  # fmt: skip
    (tmp_path / "fired" / "statelens" / "guards.jsonl").write_text(json.dumps(firing) + "\n")
    (tmp_path / "quiet" / "statelens" / "guards.jsonl").write_text("")
    runs = [load_run(tmp_path / name) for name in ("fired", "quiet", "unwatched")]
    page = write_states_page(runs, tmp_path / "states.html").read_text()
    table = page[page.index('<table id="guards">') : page.index("</table>", page.index('<table id="guards">'))]
    assert "<h2>Guards (during training)</h2>" in page
    for shown in (
        "fired",
        "7",
        "loop",
        "warn",
        "statelens/ends/repeats",
        "0.25",
        "repeats rose &lt;0.25 -&gt; 0.5&gt;",
    ):
        assert f"<td>{shown}</td>" in table
    assert "<td>quiet</td>" in table and "<td>no guard fired</td>" in table and "unwatched" not in table
    page = write_states_page(runs[2:], tmp_path / "none.html").read_text()
    assert 'id="guards"' not in page and "{guards}" not in page


# ----- what the browser shows ---------------------------------------------------------------------------------------
VISIBLE = "Number(document.getElementById('sequences').dataset.visible)"


def no_console_errors(browser) -> None:
    errors = [entry for entry in browser.console() if entry["level"] == "SEVERE"]
    assert errors == [], errors
    assert browser.run("return document.getElementById('errors').hidden") is True


@needs_browser
@pytest.mark.slow
def test_page_renders_and_filters_in_chromium(browser, report_dir, tensorboard_opd_run):
    browser.open(report_dir / "states.html")
    total = 4 * 8 + 16  # the real run, and the second folder with half of its ledger
    assert browser.run(f"return {VISIBLE}") == total
    assert browser.run("return document.querySelectorAll('#sequences .seq').length") == 40  # one page
    assert browser.run("return document.querySelectorAll('#sequences .tok').length") > 40 * 5
    assert browser.run("return document.querySelectorAll('svg.heatmap').length") == 2
    assert browser.run("return document.querySelectorAll('svg.heatmap rect.cell').length") >= 4
    assert browser.run("return document.querySelectorAll('svg.line-chart').length") >= 3
    # hovering a token shows its values: the third token of the first sequence has prefix length 2
    browser.hover("#sequences .seq:nth-child(1) .tok:nth-child(3)")
    tooltip = browser.run("return document.getElementById('tooltip').innerText")
    assert "prefix length\t2" in tooltip and "teacher log p" in tooltip
    no_console_errors(browser)

    # unticking the learner source leaves only dataset sequences, and the fragment says so
    browser.click("#source-boxes label:nth-child(2) input")
    shown = browser.run(
        "return [...document.querySelectorAll('#sequences .seq-head .badge.source')].map(b => b.textContent)"
    )
    assert 0 < len(shown) < total and set(shown) == {"dataset"}
    # each sampled rollout says how it ended (`lens.endings`)
    ends = browser.run("return [...document.querySelectorAll('.badge[class*=\"end-\"]')].map(b => b.textContent)")
    assert ends and set(ends) <= {"ended: end token", "cut at the length limit", "stopped short"}
    assert browser.run(f"return {VISIBLE}") == len(shown)
    assert "source=dataset" in browser.run("return location.hash")

    # a step range and a sort from the fragment; colouring by the teacher gap changes the token colours
    browser.open(report_dir / "states.html", "#steps=2-3&sort=gap&color=gap")
    steps = browser.run("return [...document.querySelectorAll('.seq-head')].map(h => h.textContent)")
    assert steps and all(" step 2 " in h or " step 3 " in h for h in steps)
    # the step range shows on every heatmap and chart, as two lines bounding it
    charts = browser.run("return document.querySelectorAll('svg.chart').length")
    assert browser.run("return document.querySelectorAll('svg.chart g.selection line').length") == 2 * charts
    gaps = [float(h.split("off-policy gap ")[1].split(" ")[0]) for h in steps]
    assert gaps == sorted(gaps, reverse=True)
    colours = browser.run("return new Set([...document.querySelectorAll('.tok')].map(t => t.style.background)).size")
    assert colours > 10
    no_console_errors(browser)


@needs_browser
@pytest.mark.slow
def test_teacher_filter_and_colour_in_chromium(browser, tmp_path):
    synthetic_ledger(tmp_path / "two", num_sequences=12, num_steps=2, tokens=4, teachers=("math", "kb"))
    synthetic_ledger(tmp_path / "one", num_sequences=4, num_steps=2, tokens=4)
    path = write_states_page([load_run(tmp_path / "two"), load_run(tmp_path / "one")], tmp_path / "states.html")
    browser.open(path)
    assert browser.run("return document.getElementById('teacher-field').hidden") is False
    assert browser.run(f"return {VISIBLE}") == 16  # every teacher ticked: the single-teacher run shows too
    heads = "return [...document.querySelectorAll('#sequences .seq-head .badge.teacher')].map(b => b.textContent)"
    assert sorted(browser.run(heads)) == ["kb"] * 6 + ["math"] * 6
    browser.click("#teacher-boxes label:nth-child(1) input")  # untick kb (names sorted)
    assert browser.run(f"return {VISIBLE}") == 6 and set(browser.run(heads)) == {"math"}
    assert "teacher=math" in browser.run("return location.hash")
    browser.open(path, "#color=teacher_id")
    assert browser.run("return document.getElementById('color-by').value") == "teacher_id"
    legend = browser.run("return document.getElementById('legend').textContent")
    assert "teacher" in legend and "kb" in legend and "math" in legend
    # two teachers' tints, and grey for the run without teachers
    colours = browser.run("return [...new Set([...document.querySelectorAll('.tok')].map(t => t.style.background))]")
    assert len(colours) == 3
    no_console_errors(browser)
    single = write_states_page([load_run(tmp_path / "one")], tmp_path / "single.html")
    browser.open(single, "#color=teacher_id")  # no such colouring without teachers: the default instead
    assert browser.run("return document.getElementById('teacher-field').hidden") is True
    assert browser.run("return document.getElementById('color-by').value") == "source"
    no_console_errors(browser)


@needs_browser
@pytest.mark.slow
def test_big_ledger_page_stays_responsive(browser, big_page):
    browser.open(big_page[1])
    render_ms = float(browser.run("return document.body.dataset.renderMs"))
    assert browser.run(f"return {VISIBLE}") == MAX_SEQUENCES
    started = time.perf_counter()
    browser.click("#source-boxes label:nth-child(1) input")  # untick dataset: re-filter and re-render
    assert browser.run(f"return {VISIBLE}") == MAX_SEQUENCES // 2
    click_ms = 1000 * (time.perf_counter() - started)
    no_console_errors(browser)
    print(f"10k-sequence ledger ({MAX_SEQUENCES} embedded): first render {render_ms:.0f} ms, filter {click_ms:.0f} ms")


@needs_browser
@pytest.mark.skipif(not os.environ.get("STATELENS_SCREENSHOT"), reason="set STATELENS_SCREENSHOT=RUN_DIR to refresh")
def test_screenshot_for_the_readme(browser, tmp_path):
    """`STATELENS_SCREENSHOT=runs/lab/opd pytest tests/test_states_html.py -k screenshot` refreshes the README's
    picture, docs/states_page.png."""
    path = write_states_page([load_run(os.environ["STATELENS_SCREENSHOT"])], tmp_path / "states.html")
    browser.open(path, os.environ.get("STATELENS_SCREENSHOT_VIEW", "#color=gap"))
    browser.hover(os.environ.get("STATELENS_SCREENSHOT_HOVER", ".seq:nth-child(2) .tok:nth-child(6)"))
    assert browser.run("return document.getElementById('tooltip').hidden") is False
    no_console_errors(browser)
    browser.screenshot(Path(__file__).parents[1] / "docs" / "states_page.png")


def _self_teacher_ledger(run_dir: Path) -> None:
    """A small ledger whose odd sequences' teacher read a prompt of its own (a self teacher's privileged prompt)."""
    synthetic_ledger(run_dir, num_sequences=4, num_steps=2, tokens=5)
    ledger = run_dir / "statelens" / "states.jsonl"
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    for index, line in enumerate(lines):
        if index % 2:
            line["teacher_prompt"] = line["prompt"] + "\nReference: 3 + 4 = 7"
            line["teacher_context_len"] = 9
    ledger.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_page_embeds_what_a_self_teacher_saw(tmp_path):
    _self_teacher_ledger(tmp_path / "run")
    entries = page_data([load_run(tmp_path / "run")])["sequences"]
    assert [(entry["tp"], entry["tc"]) for entry in entries[::2]] == [(None, None)] * 2
    for entry in entries[1::2]:
        assert entry["tp"] == entry["p"] + "\nReference: 3 + 4 = 7" and entry["tc"] == 9


@needs_browser
def test_teacher_prompt_shows_beside_the_students(browser, tmp_path):
    _self_teacher_ledger(tmp_path / "run")
    browser.open(write_states_page([load_run(tmp_path / "run")], tmp_path / "states.html"))
    assert browser.run("return document.querySelectorAll('#sequences .seq').length") == 4
    assert browser.run("return document.querySelectorAll('#sequences .prompts').length") == 2  # side by side
    teacher = browser.run("return [...document.querySelectorAll('.teacher-prompt')].map(p => p.innerText)")
    assert len(teacher) == 2 and all(t.startswith("teacher's prompt (+9 tokens)") and "Reference: 3 + 4 = 7" in t
                                     for t in teacher)  # fmt: skip
    no_console_errors(browser)


def _selection_ledger(run_dir: Path) -> None:
    """A small ledger of a run with state selection: sequence 0 skipped as correct, 1 rechecked, the rest scored."""
    synthetic_ledger(run_dir, num_sequences=4, num_steps=2, tokens=5)
    ledger = run_dir / "statelens" / "states.jsonl"
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    for index, line in enumerate(lines):
        line.update(teacher_scored=index != 0, skipped="correct" if index == 0 else None, recheck=index == 1)
        if index == 0:
            line.update(teacher_logp=None, weight=[0.0] * 5)
    ledger.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_page_embeds_which_sequences_the_teacher_skipped(tmp_path):
    _selection_ledger(tmp_path / "run")
    entries = page_data([load_run(tmp_path / "run")])["sequences"]
    assert [entry["sk"] for entry in entries] == ["correct", "recheck", None, None]


@needs_browser
def test_skipped_sequences_are_marked_in_the_page(browser, tmp_path):
    _selection_ledger(tmp_path / "run")
    browser.open(write_states_page([load_run(tmp_path / "run")], tmp_path / "states.html"))
    assert browser.run("return document.querySelectorAll('#sequences .seq').length") == 4
    skipped = browser.run("return [...document.querySelectorAll('#sequences .seq.skipped')].map(s => s.innerText)")
    assert len(skipped) == 1 and "skipped: correct" in skipped[0] and "not supervised" in skipped[0]
    badges = browser.run("return [...document.querySelectorAll('.badge.recheck')].map(b => b.innerText)")
    assert badges == ["recheck"]
    no_console_errors(browser)
