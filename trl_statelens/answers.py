"""Final-answer extraction and comparison for GSM8K-style math, in two flavours.

The package's own (the ``statelens`` evaluation protocol and the GRPO/OPD rewards), :func:`extract_answer`:

- ``strict``: the number after the first ``####`` (spaces and a ``$`` allowed between them); a model that does not
  write the GSM8K answer format scores nothing, so this also measures whether the format was learned;
- ``flexible``: the last number anywhere in the text (credits a right answer written in another layout).

Both return a *normalised* number string, so ``"$1,200.00"``, ``"1200."`` and ``"1200"`` all compare equal:
commas, ``$`` and ``%`` signs and a trailing ``.`` are dropped, integer-valued decimals lose their fraction and
other decimals their trailing zeros, and a Unicode minus becomes ``-``.

lm-evaluation-harness 0.4.x's ``gsm8k`` filters (the ``lm-eval`` protocol), :func:`lm_eval_extract` and
:func:`lm_eval_exact_match`: ``strict-match`` takes the first ``#### (\\-?[0-9\\.\\,]+)`` (exactly one space after
``####``, no ``$``), ``flexible-extract`` the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, either ``"[invalid]"``
when nothing matches; the extracted string then equals the reference solution after both drop ``,``, ``$``,
everything up to ``"#### "`` and a final ``.``, ignoring case. So ``#### 18.00``, ``####18`` and ``#### $18`` are
wrong under lm-eval's strict filter and right under ours.
Beside them, two guards for metrics a degenerate answer satisfies (a ``#### N`` then a loop): :func:`clean_format`
(exactly one ``#### N`` line and nothing after ``N``: the answer ends there) and :func:`repeats_itself` (more than one
final-answer line, the same line twice, or a short word n-gram that comes back :data:`NGRAM_REPEATS` times). They sit
beside the strict score in evaluation records (``clean_format``, ``repeats``) and in the lens (``lens.endings``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

EXTRACTION_MODES = ("strict", "flexible")

# A number as models and GSM8K write them: optional sign and dollar sign (either order), comma-grouped or plain
# digits, optional decimals. Comma groups must have exactly three digits, so "1,2,3" is three numbers.
NUMBER_REGEX = r"(?:-\$?|\$-?)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
NUMBER_PATTERN = re.compile(NUMBER_REGEX)
STRICT_PATTERN = re.compile(r"####\s*(" + NUMBER_REGEX + ")")

# lm-eval 0.4.x gsm8k.yaml: the two filters' (pattern, which match) and exact_match's regexes_to_ignore.
LM_EVAL_FILTERS = {
    "strict": (re.compile(r"#### (\-?[0-9\.\,]+)"), 0),
    "flexible": (re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)"), -1),
}
LM_EVAL_IGNORED = (",", r"\$", r"(?s).*#### ", r"\.$")
LM_EVAL_INVALID = "[invalid]"


def normalize_number(text: str) -> str | None:
    """``"$1,234.50"`` -> ``"1234.5"``, ``"5.00"`` -> ``"5"``, ``"-7."`` -> ``"-7"``; ``None`` if not a number."""
    cleaned = text.strip().replace("\u2212", "-").replace(",", "").replace("$", "").replace("%", "").rstrip(".")
    if cleaned.startswith("+"):
        cleaned = cleaned[1:]
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str, mode: str = "strict") -> str | None:
    """The final answer of a GSM8K-style solution as a normalised number string, or ``None`` if there is none.

    ``strict`` reads the number after the first ``####``; ``flexible`` the last number in the text.
    """
    if mode not in EXTRACTION_MODES:
        raise ValueError(f"unknown extraction mode {mode!r}: use one of {EXTRACTION_MODES}")
    text = text.replace("\u2212", "-")
    if mode == "strict":
        found = STRICT_PATTERN.search(text)
        return normalize_number(found.group(1)) if found else None
    numbers = NUMBER_PATTERN.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def lm_eval_extract(text: str, mode: str = "strict") -> str:
    """lm-eval's ``strict-match`` (``mode="strict"``) or ``flexible-extract`` answer of a completion, or
    ``"[invalid]"``. Of a match with two groups, the first non-empty one."""
    if mode not in LM_EVAL_FILTERS:
        raise ValueError(f"unknown extraction mode {mode!r}: use one of {tuple(LM_EVAL_FILTERS)}")
    pattern, which = LM_EVAL_FILTERS[mode]
    found = pattern.findall(text)
    if not found:
        return LM_EVAL_INVALID
    match = found[which]
    if isinstance(match, tuple):
        match = next((group for group in match if group), LM_EVAL_INVALID)
    return match.strip()


def lm_eval_exact_match(prediction: str, reference: str) -> bool:
    """lm-eval's gsm8k ``exact_match``: equal after dropping :data:`LM_EVAL_IGNORED` from both, ignoring case.
    ``reference`` is the whole GSM8K solution (its ``#### N`` line decides)."""
    for pattern in LM_EVAL_IGNORED:
        prediction, reference = re.sub(pattern, "", prediction), re.sub(pattern, "", reference)
    return prediction.lower() == reference.lower()


def answers_match(predicted: str | None, gold: str | None, use_math_verify: bool = False) -> bool:
    """Whether two extracted answers are the same number.

    Normalised string equality decides GSM8K (integer answers). ``use_math_verify=True`` additionally asks
    `math-verify <https://github.com/huggingface/Math-Verify>`_ (the optional ``math`` extra) when the strings
    differ, for answer strings such as ``"1/2"`` and ``"0.5"``; it can only turn a miss into a hit. The numbers
    :func:`extract_answer` returns never need it: to let math-verify read a whole completion, use
    :func:`math_verify_match`.
    """
    if predicted is None or gold is None:
        return False
    predicted_norm, gold_norm = normalize_number(predicted), normalize_number(gold)
    if predicted_norm is not None and predicted_norm == gold_norm:
        return True
    if predicted.strip() == gold.strip():
        return True
    if not use_math_verify:
        return False
    return math_verify_match(predicted, gold)


def math_verify_match(text: str, gold: str) -> bool:
    """Whether math-verify finds ``gold``'s value in ``text`` (a whole completion: LaTeX, ``\\boxed{}``, fractions).

    Its timeouts are off (they use ``signal.alarm``, which only works on the main thread), so this also runs in
    dataloader workers and reward threads.
    """
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("use_math_verify=True needs math-verify: pip install 'trl-statelens[math]'") from err
    return bool(verify(parse(gold, parsing_timeout=None), parse(text, parsing_timeout=None), timeout_seconds=None))


FINAL_ANSWER_MARK = "####"
# A loop is a run of `NGRAM_SIZE` words seen `NGRAM_REPEATS` times. Checked on GSM8K's 7,473 train solutions
# (6 flagged, 0.08%: real repeated work such as "16 tables have 2 chairs each for a total of") and on the real-model study's looping answers (tests/test_answer_guards.py).
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
