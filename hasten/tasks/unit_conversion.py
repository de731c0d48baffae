"""Unit conversion questions, in the style of a well-known RL course homework.

Seeded questions such as "How many grams are there in 6 kg?" or "Convert 3
miles to kilometers." across length, mass, time, volume, data size and speed.
Every conversion is a fixed factor, so the answer is exact (temperature is
left out because it is affine, not a factor). A completion is correct within
5% relative error: enough to forgive 1024-vs-1000 for data sizes or a rounded
mile, not enough to accept a wrong power of ten.

The prompt is built to give a ~100M-parameter model a chance from step 0: a
short system prompt, then ONE worked example as a prior user/assistant turn,
then the question. Every prompt token costs compute on every sample, so the
example is kept to one line of working; `WORKED_EXAMPLE` is the knob to tune.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from hasten.config import TaskConfig
from hasten.rewards.builtin import DEFAULT_TOLERANCE, correctness_reward, format_reward
from hasten.rewards.runner import RewardFunction
from hasten.tasks import DESCRIPTIONS
from hasten.tasks.base import Task, chat_prompt, check_numeric_answer, generate_split

DESCRIPTION = DESCRIPTIONS["unit-conversion"]  # one text, in the registry (listed without importing this)

SYSTEM_PROMPT = "Answer briefly. Put the final number inside <answer></answer>."

# (user question, assistant answer): shown before every question.
WORKED_EXAMPLE = (
    "How many grams are there in 2 kg?",
    "1 kg = 1000 g, so 2 kg = 2 * 1000 = 2000 g.\n<answer>2000</answer>",
)


@dataclass(frozen=True)
class Unit:
    singular: str
    plural: str
    symbol: str  # also the key in UNITS and CONVERSIONS
    symbol_in_questions: bool = True  # False where the symbol reads oddly in prose ("3 d")


UNITS = {
    unit.symbol: unit
    for unit in [
        Unit("millimeter", "millimeters", "mm"),
        Unit("centimeter", "centimeters", "cm"),
        Unit("meter", "meters", "m"),
        Unit("kilometer", "kilometers", "km"),
        Unit("inch", "inches", "in"),
        Unit("foot", "feet", "ft"),
        Unit("yard", "yards", "yd"),
        Unit("mile", "miles", "mi"),
        Unit("milligram", "milligrams", "mg"),
        Unit("gram", "grams", "g"),
        Unit("kilogram", "kilograms", "kg"),
        Unit("tonne", "tonnes", "t", symbol_in_questions=False),
        Unit("ounce", "ounces", "oz"),
        Unit("pound", "pounds", "lb"),
        Unit("second", "seconds", "s"),
        Unit("minute", "minutes", "min"),
        Unit("hour", "hours", "h"),
        Unit("day", "days", "d", symbol_in_questions=False),
        Unit("week", "weeks", "wk", symbol_in_questions=False),
        Unit("milliliter", "milliliters", "mL"),
        Unit("liter", "liters", "L"),
        Unit("cup", "cups", "cup", symbol_in_questions=False),
        Unit("fluid ounce", "fluid ounces", "fl oz"),
        Unit("quart", "quarts", "qt"),
        Unit("gallon", "gallons", "gal"),
        Unit("bit", "bits", "bit", symbol_in_questions=False),
        Unit("byte", "bytes", "B"),
        Unit("kilobyte", "kilobytes", "KB"),
        Unit("megabyte", "megabytes", "MB"),
        Unit("gigabyte", "gigabytes", "GB"),
        Unit("kilometer per hour", "kilometers per hour", "km/h"),
        Unit("meter per second", "meters per second", "m/s"),
        Unit("mile per hour", "miles per hour", "mph"),
    ]
}

# (larger unit, smaller unit, how many smaller units make one larger). Both
# directions are asked; exact definitions (inch = 2.54 cm, pound = 0.45359237
# kg, US gallon = 3.785411784 L, decimal data sizes).
CONVERSIONS: list[tuple[str, str, float]] = [
    ("km", "m", 1000),
    ("m", "cm", 100),
    ("m", "mm", 1000),
    ("cm", "mm", 10),
    ("ft", "in", 12),
    ("yd", "ft", 3),
    ("mi", "ft", 5280),
    ("mi", "km", 1.609344),
    ("in", "cm", 2.54),
    ("kg", "g", 1000),
    ("g", "mg", 1000),
    ("t", "kg", 1000),
    ("lb", "oz", 16),
    ("kg", "lb", 1 / 0.45359237),
    ("h", "min", 60),
    ("min", "s", 60),
    ("d", "h", 24),
    ("wk", "d", 7),
    ("L", "mL", 1000),
    ("gal", "qt", 4),
    ("gal", "L", 3.785411784),
    ("cup", "fl oz", 8),
    ("B", "bit", 8),
    ("KB", "B", 1000),
    ("MB", "KB", 1000),
    ("GB", "MB", 1000),
    ("m/s", "km/h", 3.6),
    ("mph", "km/h", 1.609344),
]

# {value} is a number, {source} the unit it is in, {target} the unit asked for.
TEMPLATES = [
    "How many {target} are there in {value} {source}?",
    "Convert {value} {source} to {target}.",
    "What is {value} {source} in {target}?",
    "Can you change {value} {source} to its equivalent in {target}?",
]


def format_value(value: float) -> str:
    """3.0 -> '3', 2.5 -> '2.5': how a person would write the quantity."""
    return str(int(value)) if value == int(value) else f"{value:g}"


def _source_value(rng: random.Random, factor: float) -> float:
    """A realistic quantity to convert, given target units per source unit."""
    count = rng.randint(1, 20) if rng.random() < 0.8 else rng.randint(1, 19) + rng.choice([0.25, 0.5, 0.75])
    if factor >= 1:
        return float(count)  # large -> small: "6 kg", "2.5 hours"
    per_target = round(1 / factor)
    if abs(per_target * factor - 1) < 1e-9:
        return float(count * per_target)  # small -> large by an exact ratio: "3000 g", "90 minutes"
    return float(rng.randint(1, 50))  # small -> large by an odd ratio: "8 km" to miles


def _unit_text(rng: random.Random, unit: Unit, value: float | None) -> str:
    """Symbol or word for a unit; words agree with the value ("1 mile", "3 miles")."""
    if value is not None and unit.symbol_in_questions and rng.random() < 0.5:
        return unit.symbol
    return unit.singular if value == 1 else unit.plural


def sample_question(rng: random.Random) -> tuple[str, float]:
    """One (question, exact answer) pair."""
    larger, smaller, ratio = rng.choice(CONVERSIONS)
    source, target, factor = (larger, smaller, ratio) if rng.random() < 0.6 else (smaller, larger, 1 / ratio)
    value = _source_value(rng, factor)
    question = rng.choice(TEMPLATES).format(
        value=format_value(value),
        source=_unit_text(rng, UNITS[source], value),
        target=_unit_text(rng, UNITS[target], None),
    )
    # 12 significant digits drops float noise such as 7.619999999 for 3 * 2.54.
    return question, float(f"{value * factor:.12g}")


def build_unit_conversion(cfg: TaskConfig) -> Task:
    system_prompt = cfg.system_prompt if cfg.system_prompt is not None else SYSTEM_PROMPT

    def sample(rng: random.Random) -> dict[str, Any]:
        question, answer = sample_question(rng)
        return {
            "prompt": chat_prompt(question, system_prompt, examples=(WORKED_EXAMPLE,) if cfg.worked_example else ()),
            "answer": answer,
            "question": question,
            "tolerance": DEFAULT_TOLERANCE,
        }

    train_rows, eval_rows = generate_split(
        sample, cfg.num_train, cfg.num_eval, cfg.seed, exclude={WORKED_EXAMPLE[0]}
    )
    return Task(
        name="unit-conversion",
        description=DESCRIPTION,
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_functions=[
            RewardFunction("format", format_reward, weight=0.25),
            RewardFunction("correct", correctness_reward, weight=1.0),
        ],
        check=check_numeric_answer,
    )
