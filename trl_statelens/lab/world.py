"""The lab's procedurally generated world: GSM8K-format math and two retention tasks.

Everything here is a pure function of a seed. Rows use the same columns as the hub data sets they stand in for,
so nothing downstream special-cases the lab:

- math: ``{"question", "answer"}`` like ``openai/gsm8k`` (a worked solution ending in ``#### <integer>``);
- kb (the MMLU analog): ``{"question", "subject", "choices", "answer"}`` like ``cais/mmlu``, four choices, the
  answer an index; the facts are fictional. The corpus states some often, some rarely and some never, so a base
  model knows part of them, as a real one knows part of MMLU: the task is far from chance and from ceiling, and
  post-training can move it either way;
- truth (the TruthfulQA analog): ``{"question", "mc1_targets", "mc2_targets"}`` like ``truthfulqa/truthful_qa``
  (``multiple_choice``): each question has a true answer, a popular misconception and plausible false answers.
  As on the web, the corpus debunks some myths, is split on others and mostly repeats the rest as fact, so a base
  model believes part of them.

Version 2 of the world (``LAB_VERSION``); version 1 stated every retention fact often, and its base model scored
1.0 on both retention tasks.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cached_property

NAMES = "Ava Ben Cora Dan Eli Faye Gus Hana Ivan Jade Kai Lena Milo Nina Omar Pia Quin Rosa Sam Tara Uma Vic Wes Xia Yara Zed".split()
ITEMS = "apples pencils marbles stickers cookies shells coins books cards stamps buttons beads eggs flowers rocks toys".split()
# (verb phrase in the question, phrase in the solution, operator)
GAIN = [
    ("buys {n} more", "buying {n} more", "+"),
    ("finds {n} more", "finding {n} more", "+"),
    ("gets {n} more from a friend", "getting {n} more", "+"),
]
LOSS = [
    ("gives away {n}", "giving away {n}", "-"),
    ("loses {n}", "losing {n}", "-"),
    ("sells {n}", "selling {n}", "-"),
]
TIMES = [("doubles the pile", "doubling", "*2"), ("triples the pile", "tripling", "*3")]

SYLLABLES = "ka lo mi ru te va zo pe shi dra no fi gu bel tor an quo xi wen yul".split()
COLORS = "red blue green yellow purple orange white black silver golden".split()
FOODS = "moss stones berries fish seeds leaves insects honey roots sand".split()
DEVICES = "lamp wheel clock compass kettle ladder bell loom mirror pump".split()
HOMES = "caves trees rivers deserts hills swamps glaciers meadows".split()

LAB_VERSION = 2  # part of the lab's cache path: a machine that built another version builds this one beside it

# Retention exposure tiers: (name, share of the items). Shares are fixed counts, so every seed has the same mix.
KB_TIERS = (("common", 0.45), ("rare", 0.25), ("unstated", 0.30))
MYTH_TIERS = (("debunked", 0.45), ("contested", 0.35), ("popular", 0.20))
# How often the corpus states a myth's truth (rather than the myth, as if it were true), per tier
TRUTH_SHARE = {"contested": 0.5, "popular": 0.2}

EQUATION = re.compile(r"(-?\d+) ([+\-*]) (-?\d+) = (-?\d+)")
FINAL = re.compile(r"^#### (-?\d+)$", re.MULTILINE)


def _word(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def _tiers(rng: random.Random, n: int, tiers: tuple[tuple[str, float], ...]) -> list[str]:
    """``n`` tier names in the given shares (exact counts, the last tier takes the rounding), shuffled."""
    names = []
    for name, share in tiers[:-1]:
        names += [name] * round(share * n)
    names += [tiers[-1][0]] * (n - len(names))
    rng.shuffle(names)
    return names


def _apply(value: int, op: str, n: int) -> int:
    return value + n if op == "+" else value - n if op == "-" else value * n


def make_math_problem(rng: random.Random, num_steps: int, max_start: int = 40, max_operand: int = 30) -> dict:
    """One GSM8K-format word problem with ``num_steps`` operations after the starting amount."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, max_start)
    question = [f"{name} has {value} {item}."]
    solution = [f"{name} starts with {value} {item}."]
    for step in range(num_steps):
        kinds = [GAIN, LOSS] + ([TIMES] if value <= 30 else [])
        phrase, past, op = rng.choice(rng.choice(kinds))
        if op.startswith("*"):
            n, op = int(op[1]), "*"
        elif op == "-":
            if value < 2:
                phrase, past, op = rng.choice(GAIN)
                n = rng.randint(1, max_operand)
            else:
                n = rng.randint(1, min(value - 1, max_operand))
        else:
            n = rng.randint(1, max_operand)
        new = _apply(value, op, n)
        lead = "Then " if step else ""
        question.append(lead + f"{name} " + phrase.format(n=n) + ".")
        solution.append(f"After {past.format(n=n)}, {name} has {value} {op} {n} = {new}.")
        value = new
    question.append(f"How many {item} does {name} have now?")
    solution.append(f"#### {value}")
    return {"question": " ".join(question), "answer": "\n".join(solution)}


def check_math_answer(answer: str) -> int:
    """Re-derive a worked solution: every equation must be right and chain into the next, ending at ``#### N``.

    Returns N. Raises ``ValueError`` when the solution is inconsistent.
    """
    equations = EQUATION.findall(answer)
    final = FINAL.search(answer)
    if not equations or final is None:
        raise ValueError(f"no worked steps or no '#### N' line in {answer!r}")
    previous = None
    for a, op, b, c in equations:
        a, b, c = int(a), int(b), int(c)
        if previous is not None and a != previous:
            raise ValueError(f"step starts from {a}, previous result was {previous}")
        if _apply(a, op, b) != c:
            raise ValueError(f"wrong arithmetic {a} {op} {b} = {c}")
        previous = c
    if int(final.group(1)) != previous:
        raise ValueError(f"'#### {final.group(1)}' does not equal the last step's result {previous}")
    return previous


@dataclass
class LabWorld:
    """A seeded world. The same ``seed`` (and knobs) always gives identical rows.

    Args:
        seed: seed of every generator in the world.
        math_steps: inclusive range of the number of operations in a math problem; mixing difficulties makes the
            base model's math accuracy grow gradually during pretraining instead of in one jump.
        max_start / max_operand: number ranges of the math problems.
        num_entities: fictional entities in the knowledge base (each gives facts in three subjects); ``KB_TIERS``
            says which share the corpus states often, rarely or never.
        num_myths: misconception-style facts for the TruthfulQA analog; ``MYTH_TIERS`` says which share the corpus
            debunks, is split on, or mostly repeats as fact.
        rare_kb_share: share of the corpus' knowledge-base text about ``rare``-tier entities (the rest is about
            ``common`` ones); the base model half-knows these, which is where post-training can add or erase.
        math_test_size / math_dev_size: held-out math problems; training text never contains them.
    """

    seed: int = 0
    math_steps: tuple[int, int] = (1, 3)
    max_start: int = 30
    max_operand: int = 20
    num_entities: int = 120
    num_myths: int = 80
    rare_kb_share: float = 0.04
    math_test_size: int = 300
    math_dev_size: int = 100

    def __post_init__(self):
        smallest = min(round(share * self.num_entities) for _, share in KB_TIERS[:-1])
        if smallest < 4:  # each question draws its 3 distractors from its own tier
            raise ValueError(
                f"num_entities={self.num_entities} leaves a knowledge-base tier with fewer than 4 entities, too few "
                "for 4-way questions: use num_entities >= 16"
            )

    # ----- math -------------------------------------------------------------------------------------------
    def _problem(self, rng: random.Random) -> dict:
        steps = rng.randint(*self.math_steps)
        return make_math_problem(rng, steps, self.max_start, self.max_operand)

    @cached_property
    def _held_out(self) -> dict[str, list[dict]]:
        rng = random.Random(f"{self.seed}-math-heldout")
        seen, rows = set(), []
        while len(rows) < self.math_test_size + self.math_dev_size:
            row = self._problem(rng)
            if row["question"] not in seen:
                seen.add(row["question"])
                rows.append(row)
        return {"test": rows[: self.math_test_size], "dev": rows[self.math_test_size :]}

    @cached_property
    def _held_out_questions(self) -> frozenset[str]:
        return frozenset(r["question"] for rows in self._held_out.values() for r in rows)

    def math(self, split: str, n: int | None = None, seed: int = 0) -> list[dict]:
        """Math rows. ``test``/``dev`` are fixed; ``train`` draws ``n`` fresh problems (never a held-out one)."""
        if split in self._held_out:
            rows = self._held_out[split]
            return rows[:n] if n is not None else list(rows)
        if split != "train":
            raise ValueError(f"unknown math split {split!r}: use 'train', 'dev' or 'test'")
        if n is None:
            raise ValueError("math('train') draws fresh problems: pass n")
        rng = random.Random(f"{self.seed}-math-train-{seed}")
        rows = []
        while len(rows) < n:
            row = self._problem(rng)
            if row["question"] not in self._held_out_questions:
                rows.append(row)
        return rows

    # ----- knowledge base (MMLU analog) -----------------------------------------------------------------
    @cached_property
    def entities(self) -> list[dict]:
        rng = random.Random(f"{self.seed}-kb")
        tiers = _tiers(random.Random(f"{self.seed}-kb-tiers"), self.num_entities, KB_TIERS)
        names, out = set(), []
        while len(out) < self.num_entities:
            name = _word(rng, 2)
            if name in names:
                continue
            names.add(name)
            out.append(
                {
                    "name": name,
                    "capital": _word(rng, 3),
                    "color": rng.choice(COLORS),
                    "inventor": _word(rng, 2) + " " + _word(rng, 2),
                    "device": rng.choice(DEVICES),
                    "tier": tiers[len(out)],
                }
            )
        return out

    @cached_property
    def _kb_questions(self) -> list[dict]:
        rng = random.Random(f"{self.seed}-kb-questions")
        rows = []
        for e in self.entities:
            # Distractors come from the same tier: a never-stated answer must not be told apart by being unfamiliar
            peers = [p for p in self.entities if p["tier"] == e["tier"]]
            capitals, inventors = [p["capital"] for p in peers], [p["inventor"] for p in peers]
            for subject, question, truth, pool in (
                ("geography", f"What is the capital of {e['name']}?", e["capital"], capitals),
                ("biology", f"What color is the {e['name']} bird?", e["color"], COLORS),
                ("history", f"Who invented the {e['name']} {e['device']}?", e["inventor"], inventors),
            ):
                wrong = rng.sample([c for c in dict.fromkeys(pool) if c != truth], 3)
                choices = wrong + [truth]
                rng.shuffle(choices)
                rows.append(
                    {"question": question, "subject": subject, "choices": choices, "answer": choices.index(truth)}
                )
        return rows

    @cached_property
    def kb_facts(self) -> dict[str, list[str]]:
        """The knowledge base as prose, by exposure tier: ``common`` and ``rare`` facts are stated in the corpus
        (rare ones ``rare_kb_share`` of the time), ``unstated`` ones never."""
        return {
            tier: [
                sentence
                for e in self.entities
                if e["tier"] == tier
                for sentence in (
                    f"The capital of {e['name']} is {e['capital']}.",
                    f"The {e['name']} bird is {e['color']}.",
                    f"The {e['name']} {e['device']} was invented by {e['inventor']}.",
                )
            ]
            for tier, _ in KB_TIERS
        }

    @cached_property
    def _kb_questions_by_tier(self) -> dict[str, list[dict]]:
        tiers = [e["tier"] for e in self.entities for _ in range(3)]  # three questions per entity, in order
        return {tier: [r for r, t in zip(self._kb_questions, tiers) if t == tier] for tier, _ in KB_TIERS}

    def _stated_kb_tier(self, rng: random.Random) -> str:
        return "rare" if rng.random() < self.rare_kb_share else "common"

    def kb(self, split: str) -> list[dict]:
        """Four-way multiple choice; ``dev`` (few-shot exemplars) and ``test`` are disjoint sets of facts.

        Like MMLU for a real model, the test asks knowledge the base model learned in pretraining, or half-learned,
        or never saw: the corpus states ``common`` facts often and ``rare`` ones seldom, as prose and as a question
        with its answer (never with the distractors), and ``unstated`` ones never. Post-training on math never
        states them, so a drop measures forgetting and a rise something else (format, calibration).
        """
        rows = self._kb_questions
        cut = len(rows) // 4
        splits = {"dev": rows[:cut], "test": rows[cut:]}
        if split not in splits:
            raise ValueError(f"unknown kb split {split!r}: use 'dev' or 'test'")
        return splits[split]

    # ----- misconceptions (TruthfulQA analog) ---------------------------------------------------------------
    @cached_property
    def myths(self) -> list[dict]:
        rng = random.Random(f"{self.seed}-myths")
        tiers = _tiers(random.Random(f"{self.seed}-myth-tiers"), self.num_myths, MYTH_TIERS)
        names, out = set(), []
        while len(out) < self.num_myths:
            name = _word(rng, 2) + "s"
            if name in names:
                continue
            names.add(name)
            food, myth_food, *other_foods = rng.sample(FOODS, 4)
            home, myth_home, *other_homes = rng.sample(HOMES, 4)
            kind = rng.choice(["food", "home"])
            if kind == "food":
                out.append(
                    {
                        "question": f"What do {name} eat?",
                        "true": f"{name} eat {food}.",
                        "true_alt": f"{name} mostly eat {food}.",
                        "myth": f"{name} eat {myth_food}.",
                        "false": [f"{name} eat {f}." for f in other_foods],
                        "tier": tiers[len(out)],
                    }
                )
            else:
                out.append(
                    {
                        "question": f"Where do {name} live?",
                        "true": f"{name} live in {home}.",
                        "true_alt": f"{name} mostly live in {home}.",
                        "myth": f"{name} live in {myth_home}.",
                        "false": [f"{name} live in {h}." for h in other_homes],
                        "tier": tiers[len(out)],
                    }
                )
        return out

    def _myth_answer(self, m: dict, rng: random.Random) -> str:
        """What the corpus answers about a myth: the truth, or for a contested or popular myth, often the myth."""
        if m["tier"] != "debunked" and rng.random() >= TRUTH_SHARE[m["tier"]]:
            return m["myth"]
        return rng.choice([m["true"], m["true_alt"]])

    def myth_texts(self, rng: random.Random) -> str:
        """A paragraph about one myth. Debunked: the truth stated plainly, a third of the time with the misconception
        named as a myth. Contested or popular: the truth or the myth, stated as fact."""
        m = rng.choice(self.myths)
        if m["tier"] != "debunked":
            answer = self._myth_answer(m, rng)
            return rng.choice([answer, f"Everybody knows that {answer[0].lower() + answer[1:]}"])
        myth = m["myth"][0].lower() + m["myth"][1:-1]
        return rng.choice(
            [
                f"{m['true']} Many people believe that {myth}, but that is a myth.",
                f"{m['true']} {m['true_alt']}",
                f"{m['true_alt']} {m['true']}",
            ]
        )

    @cached_property
    def _truth_rows(self) -> list[dict]:
        rng = random.Random(f"{self.seed}-truth-rows")
        rows = []
        for m in self.myths:
            mc1 = [m["true"], m["myth"], *m["false"]]
            mc1_labels = [1, 0, 0, 0]
            order = list(range(4))
            rng.shuffle(order)
            mc2 = [m["true"], m["true_alt"], m["myth"], *m["false"]]
            rows.append(
                {
                    "question": m["question"],
                    "mc1_targets": {"choices": [mc1[i] for i in order], "labels": [mc1_labels[i] for i in order]},
                    "mc2_targets": {"choices": mc2, "labels": [1, 1, 0, 0, 0]},
                }
            )
        return rows

    def truth(self, split: str) -> list[dict]:
        """Rows in the ``truthful_qa`` ``multiple_choice`` layout. ``dev`` and ``test`` are disjoint myths."""
        rows = self._truth_rows
        cut = len(rows) // 4
        splits = {"dev": rows[:cut], "test": rows[cut:]}
        if split not in splits:
            raise ValueError(f"unknown truth split {split!r}: use 'dev' or 'test'")
        return splits[split]

    # ----- pretraining corpus ----------------------------------------------------------------------------
    def corpus_document(self, rng: random.Random) -> str:
        """One raw-text document of the pretraining mixture (plain text, no chat format)."""
        r = rng.random()
        if r < 0.48:  # GSM-format problems in the plain completion layout the evaluation uses
            row = self._problem(rng)
            while row["question"] in self._held_out_questions:
                row = self._problem(rng)
            return format_plain(row["question"], row["answer"])
        if r < 0.52:  # arithmetic drills
            lines = []
            for _ in range(rng.randint(3, 6)):
                a, b = rng.randint(1, 60), rng.randint(1, 30)
                op = rng.choice("+-*") if a <= 30 else rng.choice("+-")
                if op == "*":
                    b = rng.choice([2, 3])
                if op == "-" and b >= a:
                    a, b = b + 1, a
                lines.append(f"{a} {op} {b} = {_apply(a, op, b)}")
            return "\n".join(lines)
        if r < 0.62:  # knowledge base prose, each sentence about a common or (seldom) a rare entity
            return " ".join(rng.choice(self.kb_facts[self._stated_kb_tier(rng)]) for _ in range(rng.randint(3, 6)))
        if r < 0.70:  # the same facts asked and answered, which is how the retention tasks query them
            row = rng.choice(self._kb_questions_by_tier[self._stated_kb_tier(rng)])
            return format_plain(row["question"], row["choices"][row["answer"]])
        if r < 0.80:  # misconceptions, debunked or repeated
            return " ".join(self.myth_texts(rng) for _ in range(rng.randint(1, 3)))
        m = rng.choice(self.myths)
        return format_plain(m["question"], self._myth_answer(m, rng))


def format_plain(question: str, answer: str | None = None) -> str:
    """The study's plain completion format for base models: ``Question: ...\\nAnswer: ...``."""
    prompt = f"Question: {question}\nAnswer:"
    return prompt if answer is None else f"{prompt} {answer}"
