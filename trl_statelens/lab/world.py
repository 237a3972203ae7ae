"""The lab's procedurally generated world: GSM8K-format math and two retention tasks.

Everything here is a pure function of a seed. Rows use the same columns as the hub data sets they stand in for,
so nothing downstream special-cases the lab:

- math: ``{"question", "answer"}`` like ``openai/gsm8k`` (a worked solution ending in ``#### <integer>``);
- kb (the MMLU analog): ``{"question", "subject", "choices", "answer"}`` like ``cais/mmlu``, four choices, the
  answer an index; the facts are fictional and stated in the pretraining corpus;
- truth (the TruthfulQA analog): ``{"question", "mc1_targets", "mc2_targets"}`` like ``truthfulqa/truthful_qa``
  (``multiple_choice``): each question has a true answer and a popular misconception that the corpus also
  mentions (as a myth), plus plausible false answers.
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

EQUATION = re.compile(r"(-?\d+) ([+\-*]) (-?\d+) = (-?\d+)")
FINAL = re.compile(r"^#### (-?\d+)$", re.MULTILINE)


def _word(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


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
        num_entities: fictional entities in the knowledge base (each gives facts in three subjects).
        num_myths: misconception-style facts for the TruthfulQA analog.
        math_test_size / math_dev_size: held-out math problems; training text never contains them.
    """

    seed: int = 0
    math_steps: tuple[int, int] = (1, 4)
    max_start: int = 40
    max_operand: int = 30
    num_entities: int = 120
    num_myths: int = 80
    math_test_size: int = 300
    math_dev_size: int = 200

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
                }
            )
        return out

    @cached_property
    def _kb_questions(self) -> list[dict]:
        rng = random.Random(f"{self.seed}-kb-questions")
        capitals = [e["capital"] for e in self.entities]
        inventors = [e["inventor"] for e in self.entities]
        rows = []
        for e in self.entities:
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
    def kb_facts(self) -> list[str]:
        """The knowledge base as prose; the pretraining corpus states every fact."""
        return [
            sentence
            for e in self.entities
            for sentence in (
                f"The capital of {e['name']} is {e['capital']}.",
                f"The {e['name']} bird is {e['color']}.",
                f"The {e['name']} {e['device']} was invented by {e['inventor']}.",
            )
        ]

    def kb(self, split: str) -> list[dict]:
        """Four-way multiple choice; ``dev`` (few-shot exemplars) and ``test`` are disjoint sets of facts.

        Like MMLU for a real model, the test asks knowledge the base model learned in pretraining: the corpus
        states every fact as prose and as a question with its answer (never with the distractors). Post-training
        on math never touches it, so a drop measures forgetting.
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
                    }
                )
        return out

    def myth_texts(self, rng: random.Random) -> str:
        """A paragraph about one myth: the truth stated plainly, the misconception named as a myth."""
        m = rng.choice(self.myths)
        myth = m["myth"][0].lower() + m["myth"][1:-1]
        return rng.choice(
            [
                f"{m['true']} Many people believe that {myth}, but that is a myth.",
                f"{m['true']} {m['true_alt']}",
                f"It is a common myth that {myth}. In fact, {m['true'][0].lower() + m['true'][1:]}",
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
        if r < 0.30:  # GSM-format problems in the plain completion layout the evaluation uses
            row = self._problem(rng)
            while row["question"] in self._held_out_questions:
                row = self._problem(rng)
            return format_plain(row["question"], row["answer"])
        if r < 0.42:  # arithmetic drills
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
        if r < 0.62:  # knowledge base prose
            return " ".join(rng.sample(self.kb_facts, rng.randint(3, 6)))
        if r < 0.77:  # the same facts asked and answered, which is how the retention tasks query them
            row = rng.choice(self._kb_questions)
            return format_plain(row["question"], row["choices"][row["answer"]])
        if r < 0.88:  # misconceptions: the truth stated, the popular myth named as a myth
            return " ".join(self.myth_texts(rng) for _ in range(rng.randint(1, 3)))
        m = rng.choice(self.myths)
        return format_plain(m["question"], rng.choice([m["true"], m["true_alt"]]))


def format_plain(question: str, answer: str | None = None) -> str:
    """The study's plain completion format for base models: ``Question: ...\\nAnswer: ...``."""
    prompt = f"Question: {question}\nAnswer:"
    return prompt if answer is None else f"{prompt} {answer}"
