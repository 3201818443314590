"""The shipped math task: synthetic multi-step word problems with units and a ``\\boxed{}`` answer.

Problem ``i`` of seed ``s`` is drawn from its own ``random.Random`` seeded by the string ``"s:i"`` (str seeds
are hashed with SHA-512, so the set is the same on every machine and Python run, and the first ``k`` problems
do not depend on how many are written).  A record is ``{"prompt", "completion", "answer"}``: the completion is
a short worked solution, each step an ``a op b = c`` equation, ending ``\\boxed{answer}``, so the same file
serves SFT (``prompt``/``completion`` pairs) and RL (the ``answer`` a verifier checks).  :func:`read_answers`
reads these or a user's own jsonl with ``prompt`` and ``answer`` fields the same way.

``level`` (:data:`LEVELS`) is the difficulty knob: one step on small numbers, two steps, or the full multi-step
problems with units (the default), so a small model can be given a task it half solves after SFT.

    python -m megalite.rlhf.math_task OUT.jsonl --count 1000 --seed 0 --level 2
"""

from __future__ import annotations

import json
import random
import sys
from fractions import Fraction

from megalite.data.sft import jsonl_records
from megalite.flags import ArgumentParser

NAMES = ("Ana", "Ravi", "Mei", "Tom", "Sara", "Kofi", "Lena", "Omar")
INSTRUCTION = "Put the final answer in \\boxed{}."


def number(value: Fraction | int) -> str:
    """``value`` as an integer or a terminating decimal (the generators only divide by powers of ten)."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0")
    if Fraction(text) != value:
        raise ValueError(f"{value} is not a short terminating decimal")
    return text


def _step(a, op: str, b, result, unit: str = "") -> str:
    return f"{number(a)} {op} {number(b)} = {number(result)}" + (f" {unit}" if unit else "")


def _travel(rng: random.Random) -> tuple[str, list[str], Fraction]:
    name, speed, hours, more = rng.choice(NAMES), rng.randint(8, 30), rng.randint(2, 5), rng.randint(3, 40)
    first = speed * hours
    prompt = (f"{name} cycles at {speed} km/h for {hours} hours, rests, then cycles {more} km more. "
              f"How many kilometres does {name} cycle in all?")
    return prompt, [_step(speed, "*", hours, first, "km"), _step(first, "+", more, first + more, "km")], first + more


def _change(rng: random.Random) -> tuple[str, list[str], Fraction]:
    name, price, count = rng.choice(NAMES), rng.randint(15, 95), rng.randint(2, 9)
    cost = price * count
    note = cost // 100 + rng.randint(1, 4)
    prompt = (f"Pens cost {price} cents each. {name} buys {count} pens and pays with {note} dollars. "
              f"How much change does {name} get, in cents?")
    steps = [_step(price, "*", count, cost, "cents"), _step(note, "*", 100, note * 100, "cents"),
             _step(note * 100, "-", cost, note * 100 - cost, "cents")]
    return prompt, steps, note * 100 - cost


def _flour(rng: random.Random) -> tuple[str, list[str], Fraction]:
    grams, loaves, days = rng.randint(3, 9) * 50, rng.randint(2, 12), rng.randint(2, 7)
    daily = grams * loaves
    total = daily * days
    kilograms = Fraction(total, 1000)
    prompt = (f"A baker uses {grams} grams of flour per loaf and bakes {loaves} loaves a day. "
              f"How many kilograms of flour does the baker use in {days} days?")
    steps = [_step(grams, "*", loaves, daily, "g"), _step(daily, "*", days, total, "g"),
             _step(total, "/", 1000, kilograms, "kg")]
    return prompt, steps, kilograms


def _tank(rng: random.Random) -> tuple[str, list[str], Fraction]:
    start, rate, minutes = rng.randint(10, 200), rng.randint(3, 25), rng.randint(4, 30)
    capacity = start + rate * minutes
    prompt = (f"A tank holds {capacity} litres and already has {start} litres in it. A pump adds {rate} litres "
              f"per minute. How many minutes until the tank is full?")
    steps = [_step(capacity, "-", start, capacity - start, "litres"),
             _step(capacity - start, "/", rate, minutes, "minutes")]
    return prompt, steps, Fraction(minutes)


def _eggs(rng: random.Random) -> tuple[str, list[str], Fraction]:
    size, price = rng.choice((6, 10, 12)), rng.randint(2, 6)
    boxes, loose = rng.randint(3, 40), rng.randint(1, size - 1)
    eggs = boxes * size + loose
    prompt = (f"A farm collects {eggs} eggs and packs them into boxes of {size}. Each full box sells for {price} "
              f"dollars. How many dollars does the farm get for its full boxes?")
    steps = [_step(eggs, "-", loose, boxes * size, "eggs in full boxes"), _step(boxes * size, "/", size, boxes, "boxes"),
             _step(boxes, "*", price, boxes * price, "dollars")]
    return prompt, steps, Fraction(boxes * price)


ITEMS = ("apples", "stamps", "marbles", "cards", "shells")


def _count(rng: random.Random) -> tuple[str, list[str], Fraction]:
    """One step: a count that grows or shrinks, one-digit numbers."""
    name, item, have = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 9)
    change = rng.randint(1, 9) if rng.random() < 0.5 else -rng.randint(1, have - 1)  # no count is zero or less
    if change > 0:
        prompt = f"{name} has {have} {item} and gets {change} more. How many {item} does {name} have?"
        return prompt, [_step(have, "+", change, have + change, item)], Fraction(have + change)
    prompt = f"{name} has {have} {item} and gives away {-change}. How many {item} does {name} have?"
    return prompt, [_step(have, "-", -change, have + change, item)], Fraction(have + change)


def _bags(rng: random.Random) -> tuple[str, list[str], Fraction]:
    """Two steps: bags of a few items, then some more or fewer."""
    name, item, bags, size, more = (rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 5), rng.randint(2, 9),
                                    rng.randint(1, 9))
    total = bags * size
    prompt = f"{name} has {bags} bags of {size} {item} and {more} loose {item}. How many {item} does {name} have?"
    return prompt, [_step(bags, "*", size, total, item), _step(total, "+", more, total + more, item)], \
        Fraction(total + more)


def _swap(rng: random.Random) -> tuple[str, list[str], Fraction]:
    """Two steps: a count that grows, then shrinks."""
    name, item, have, gets = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(5, 20), rng.randint(1, 9)
    gives = rng.randint(1, min(9, have + gets - 1))
    prompt = (f"{name} has {have} {item}, gets {gets} more, then gives away {gives}. "
              f"How many {item} does {name} have?")
    steps = [_step(have, "+", gets, have + gets, item), _step(have + gets, "-", gives, have + gets - gives, item)]
    return prompt, steps, Fraction(have + gets - gives)


KINDS = (_travel, _change, _flour, _tank, _eggs)
"""The hardest level's generators (multi-step, unit conversions); each returns the prompt, the worked steps and
the answer."""

LEVELS = {1: (_count,), 2: (_bags, _swap), 3: KINDS}
"""The difficulty knob: the generators of each level, drawn uniformly.  1: one ``+``/``-`` step on one-digit
numbers; 2: two steps (a small product or a gain and a loss) on numbers up to 29; 3 (the default): two or three steps
on numbers in the hundreds, with money and unit conversions and decimal answers."""


def math_problem(seed: int, index: int, level: int = 3) -> dict:
    """Problem ``index`` of the set drawn with ``seed`` at difficulty ``level`` (:data:`LEVELS`):
    ``{"prompt", "completion", "answer"}``."""
    if level not in LEVELS:
        raise ValueError(f"the difficulty level must be one of {sorted(LEVELS)}, got {level!r}")
    rng = random.Random(f"{seed}:{index}")
    prompt, steps, answer = rng.choice(LEVELS[level])(rng)
    completion = ". ".join(steps) + f". The answer is \\boxed{{{number(answer)}}}."
    return {"prompt": f"{prompt} {INSTRUCTION}", "completion": completion, "answer": number(answer)}


def math_problems(count: int, seed: int = 0, level: int = 3) -> list[dict]:
    """The first ``count`` problems of ``seed`` at difficulty ``level``."""
    if not (isinstance(count, int) and count > 0):
        raise ValueError(f"the number of problems must be a positive integer, got {count!r}")
    return [math_problem(seed, index, level) for index in range(count)]


def write_math_task(path: str, count: int, seed: int = 0, level: int = 3) -> None:
    """Write :func:`math_problems` (``level`` their difficulty) to ``path`` as jsonl, one record a line."""
    records = math_problems(count, seed, level)
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def read_answers(path: str) -> list[dict]:
    """The records of a jsonl file with string ``prompt`` and ``answer`` fields (this task's or a user's own;
    other fields are kept); one ValueError naming the file and line for a malformed record."""
    records = []
    for where, record in jsonl_records(path):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
        for field in ("prompt", "answer"):
            if not isinstance(record.get(field), str) or not record[field].strip():
                raise ValueError(f"{where}: the record needs a non-empty string {field!r} field")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no problems")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description="Write the synthetic math word-problem task as jsonl.")
    parser.add_argument("out", help="the jsonl file to write")
    parser.add_argument("--count", type=int, default=1000, help="how many problems")
    parser.add_argument("--seed", type=int, default=0, help="the set's seed (use another for a held-out set)")
    parser.add_argument("--level", type=int, default=3, choices=sorted(LEVELS),
                        help="difficulty: 1 one step, 2 two small steps, 3 multi-step with units")
    args = parser.parse_args(argv)
    if args.count <= 0:
        parser.error(f"--count must be positive, got {args.count}")
    write_math_task(args.out, args.count, args.seed, args.level)
    return 0


if __name__ == "__main__":
    from megalite.cli import run_cli

    sys.exit(run_cli(main))
