"""How a GSM8K-style answer is shaped: whether it ends cleanly at one final-answer line, and whether it repeats itself.

The strict score (``answer_found``: a ``#### N`` anywhere) is satisfied by a degenerate answer that writes ``#### N``
and then loops (``#### 18\\n#### 18\\n...``, ``#### 2\\n#### 3\\n...``, ``#### 18 The answer is 18. #### 18``). These
two definitions are the guards that sit beside it, in evaluation records and in the lens alike:

- :func:`clean_format`: exactly one ``#### N`` line, and nothing but whitespace after ``N``: the answer ends there.
- :func:`repeats_itself`: the text holds a loop: more than one final-answer line, the same line twice, or a short
  word n-gram that comes back :data:`NGRAM_REPEATS` times.
"""

from __future__ import annotations

import re

from ..answers import STRICT_PATTERN

FINAL_ANSWER_MARK = "####"
# A loop is a run of `NGRAM_SIZE` words seen `NGRAM_REPEATS` times. Checked on GSM8K's 7,473 train solutions
# (6 flagged, 0.08%: real repeated work such as "16 tables have 2 chairs each for a total of") and on the real-model study's looping answers (tests/test_answer_shape.py).
NGRAM_SIZE = 10
NGRAM_REPEATS = 3
# Lines shorter than this ("", "}", "Step 1:") repeat in well-formed text and say nothing about a loop.
MIN_REPEATED_LINE = 12


def clean_format(text: str) -> bool:
    """Exactly one ``#### N`` final-answer line, with only whitespace after ``N``.

    ``"... 3 + 4 = 7\\n#### 7"`` and ``"#### 7\\n\\n"`` are clean; ``"#### 7\\n#### 7"``, ``"#### 7 The answer is 7."``
    and an answer with no ``#### N`` are not. Completions are read as an evaluation keeps them: cut at a stop
    string and with the end-of-sequence token removed.
    """
    if text.count(FINAL_ANSWER_MARK) != 1:
        return False
    found = STRICT_PATTERN.search(text)
    return found is not None and not text[found.end() :].strip()


def repeats_itself(text: str) -> bool:
    """Whether ``text`` loops: more than one ``####`` final-answer line, a line of at least
    :data:`MIN_REPEATED_LINE` characters written twice, or a word :data:`NGRAM_SIZE`-gram written
    :data:`NGRAM_REPEATS` times."""
    if text.count(FINAL_ANSWER_MARK) > 1:
        return True
    lines = [line.strip() for line in text.splitlines()]
    long_lines = [line for line in lines if len(line) >= MIN_REPEATED_LINE]
    if len(set(long_lines)) < len(long_lines):
        return True
    words = re.findall(r"\S+", text)
    seen: dict[tuple[str, ...], int] = {}
    for start in range(len(words) - NGRAM_SIZE + 1):
        gram = tuple(words[start : start + NGRAM_SIZE])
        seen[gram] = seen.get(gram, 0) + 1
        if seen[gram] >= NGRAM_REPEATS:
            return True
    return False
