"""What the README and the docs/ pages name exists: every relative link (and the heading its #anchor points at), every
`make` target, and every repository path written in backticks or in a code block.

Pages: README.md and docs/*.md (not the study data under docs/study/). A path is checked when its first part is a
top-level name of the repository (recipes/, docs/, tests/, bench/, lab/, Makefile, STUDY.md, ...) and it has a '/' or
a .py/.md/.yaml/.json ending; `*` globs, `{a,b}` alternatives and `<placeholder>` parts match any existing file.
Every failure names the page, the line and the missing target.
"""

import glob
import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})[^\n]*\n.*?^ {0,3}\2[`~]*[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
MAKE = re.compile(r"(?:^|[\s;&|(])make((?:[ \t]+[^\s;&|#)]+)+)")
PATH_TOKEN = re.compile(r"(?:[\w.\-*/]|<[\w\- ]+>|\{[^{}\s`]*\})+")
PATH_ENDINGS = (".py", ".md", ".yaml", ".json")


def blank(text: str, start: int, end: int) -> str:
    """`text` with [start, end) replaced by spaces, newlines kept, so offsets and line numbers stay put."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


@cache
def parsed(page: Path):
    """(prose, code): prose is the page with code blocks and code spans blanked; code is [(line, text, in_block)],
    one per code block line and one per code span."""
    text = page.read_text(encoding="utf-8")
    code = []
    for match in FENCE.finditer(text):
        body_start = text.index("\n", match.start()) + 1
        for number, line in enumerate(text[body_start : match.end()].split("\n")[:-1]):
            code.append((line_of(text, body_start) + number, line, True))
        text = blank(text, match.start(), match.end())
    prose = text
    for match in CODE_SPAN.finditer(text):
        code.append((line_of(text, match.start()), match.group(2), False))
        prose = blank(prose, match.start(), match.end())
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset:
    """The anchors of a Markdown page's headings (outside code blocks), with GitHub's -1, -2 for repeats."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8"))
    seen: dict = {}
    found = set()
    for match in HEADING.finditer(text):
        base = slug(match.group(1))
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return frozenset(found)


@cache
def make_targets() -> frozenset:
    rules = re.findall(r"^([^\s:=#$][^:=#]*?)[ \t]*::?(?!=)", (ROOT / "Makefile").read_text(), re.M)
    return frozenset(target for rule in rules for target in rule.split())


@cache
def top_level() -> frozenset:
    """The repository's tracked top-level names (not .venv/, runs/ or other ignored outputs)."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = {line.split("/")[0] for line in listed.splitlines() if line}
    except (OSError, subprocess.CalledProcessError):
        names = set()
    return frozenset(names or (path.name for path in ROOT.iterdir() if not path.name.startswith(".")))


def expand(pattern: str) -> list:
    """`{a,b}` alternatives, one level deep per group."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [
        p
        for part in match.group(1).split(",")
        for p in expand(pattern[: match.start()] + part + pattern[match.end() :])
    ]


def path_exists(token: str) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", token)
    for candidate in expand(pattern):
        if "*" in candidate or "?" in candidate:
            if not glob.glob(str(ROOT / candidate)):
                return False
        elif not (ROOT / candidate).exists():
            return False
    return True


def make_words(code: str, in_block: bool) -> list:
    """The targets of every `make ...` in a code span or a code block line (not in a block's comments)."""
    if in_block:
        code = re.sub(r"(^|\s)#.*", "", code)  # a shell or Python comment may say "make" as a verb
    words = [word for match in MAKE.finditer(code) for word in match.group(1).split()]
    return [word for word in words if not word.startswith("-") and "=" not in word]


def relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_every_relative_link_and_anchor_exists():
    problems = []
    for page in PAGES:
        prose, _ = parsed(page)
        for match in LINK.finditer(prose):
            target = match.group(1)
            where = f"{relative(page)}:{line_of(prose, match.start())}"
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                problems.append(f"{where}: link target '{target}': {file_part} does not exist")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                in_page = file_part or relative(page)
                problems.append(f"{where}: link target '{target}': no heading with anchor '#{anchor}' in {in_page}")
    assert not problems, "broken links in the README and docs/:\n" + "\n".join(problems)


def test_every_make_target_named_exists():
    problems = []
    targets = make_targets()
    for page in PAGES:
        for line, code, in_block in parsed(page)[1]:
            for word in make_words(code, in_block):
                if word not in targets:
                    problems.append(f"{relative(page)}:{line}: `make {word}`: no target '{word}' in the Makefile")
    assert not problems, "make targets that the Makefile lacks:\n" + "\n".join(problems)


def test_every_repository_path_named_exists():
    problems = []
    names = top_level()
    for page in PAGES:
        for line, code, _ in parsed(page)[1]:
            for token in PATH_TOKEN.findall(code):
                token = token.rstrip(".")
                first = re.split(r"[/{*<]", token, maxsplit=1)[0]
                if first not in names or not ("/" in token or token.endswith(PATH_ENDINGS) or token == first):
                    continue
                if not path_exists(token):
                    problems.append(f"{relative(page)}:{line}: `{token}` does not exist in the repository")
    assert not problems, "repository paths that do not exist:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The parsers find a link, a make target and a path in prose, code spans and code blocks, and skip URLs."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A heading, with `code`\n\nSee [the docs](docs/x.md#a-heading) and [web](https://example.com/a).\n"
        "Run `make demo` or `recipes/opd.py --max_steps 2`.\n\n```bash\nmake test   # make nothing here\n"
        "python bench/run.py\n```\n"
    )
    prose, code = parsed(page)
    assert [m.group(1) for m in LINK.finditer(prose)] == ["docs/x.md#a-heading", "https://example.com/a"]
    assert "a-heading-with-code" in anchors(page)
    assert sorted(word for _, text, in_block in code for word in make_words(text, in_block)) == ["demo", "test"]
    tokens = [t for _, text, _ in code for t in PATH_TOKEN.findall(text)]
    assert "recipes/opd.py" in tokens and "bench/run.py" in tokens
    assert {"demo", "test", "demo-real"} <= make_targets()
    assert path_exists("recipes/accelerate/zero*.yaml") and path_exists("lab/v2/seed<N>/")
    assert not path_exists("recipes/no-such-recipe.py")
