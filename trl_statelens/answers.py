"""Final-answer extraction and comparison for GSM8K-style math.

Two extraction modes, the two that lm-evaluation-harness reports for GSM8K:

- ``strict``: the number right after the first ``####`` (the GSM8K answer format; a model that does not write it
  scores nothing, so this also measures whether the format was learned);
- ``flexible``: the last number anywhere in the text (credits a right answer written in another layout).

Both return a *normalised* number string, so ``"$1,200.00"``, ``"1200."`` and ``"1200"`` all compare equal:
commas, ``$`` and ``%`` signs and a trailing ``.`` are dropped, integer-valued decimals lose their fraction and
other decimals their trailing zeros, and a Unicode minus becomes ``-``.
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


def answers_match(predicted: str | None, gold: str | None, use_math_verify: bool = False) -> bool:
    """Whether two extracted answers are the same number.

    Normalised string equality decides GSM8K (integer answers). ``use_math_verify=True`` additionally asks
    `math-verify <https://github.com/huggingface/Math-Verify>`_ (the optional ``math`` extra) when the strings
    differ, which helps for answers such as fractions or LaTeX that normalisation cannot equate.
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
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("use_math_verify=True needs math-verify: pip install 'trl-statelens[math]'") from err
    return bool(verify(parse(gold), parse(predicted)))
