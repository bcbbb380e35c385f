"""Write the iso_dates dataset: dates written the ways people write them -> ISO 8601.

    python examples/data/iso_dates/make_iso_dates.py   # rewrites train/heldout.jsonl

Each line is a chat: the user asks for a date in ``YYYY-MM-DD`` form, the assistant
answers with the date only. The skill is a rule (month name -> number, zero-padded day,
reordered fields), so it carries over to dates never seen in training: the held-out
split has its own dates (no (year, month, day) is in both splits). Seeded: running the
script again writes the same files.
"""

from __future__ import annotations

import datetime
import json
import os
import random

MONTHS = (
    "January February March April May June July August September October "
    "November December"
).split()
FORMS = (
    "{M} {d}, {y}",  # March 5, 2021
    "{d} {M} {y}",  # 5 March 2021
    "the {o} of {M}, {y}",  # the 5th of March, 2021
    "{m} {d}, {y}",  # Mar 5, 2021
    "{d} {m} {y}",  # 5 Mar 2021
    "{M} {o} {y}",  # March 5th 2021
)
ASKS = (
    "Write this date as YYYY-MM-DD: {date}",
    "Convert the date to ISO 8601 (YYYY-MM-DD): {date}",
    "What is {date} in YYYY-MM-DD format?",
)
SIZES = {"train": 320, "heldout": 80}


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ..., ``11th``, ..., ``21st``."""
    suffix = (
        "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    )
    return f"{n}{suffix}"


def spoken(day: datetime.date, form: str) -> str:
    """``day`` written in one of `FORMS`."""
    name = MONTHS[day.month - 1]
    return form.format(M=name, m=name[:3], d=day.day, o=ordinal(day.day), y=day.year)


def example(day: datetime.date, rng: random.Random) -> dict:
    """One chat record: question in a random form, answer ``YYYY-MM-DD``."""
    ask = rng.choice(ASKS).format(date=spoken(day, rng.choice(FORMS)))
    return {
        "messages": [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": day.isoformat()},
        ]
    }


def main() -> None:
    """Draw distinct dates in 1950-2039 and write both splits next to this script."""
    rng = random.Random(16)
    start, span = datetime.date(1950, 1, 1), 90 * 365
    days: list[datetime.date] = []
    seen: set[datetime.date] = set()
    while len(days) < sum(SIZES.values()):
        d = start + datetime.timedelta(days=rng.randrange(span))
        if d not in seen:
            seen.add(d)
            days.append(d)
    here = os.path.dirname(os.path.abspath(__file__))
    at = 0
    for split, n in SIZES.items():
        with open(os.path.join(here, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for d in days[at : at + n]:
                f.write(json.dumps(example(d, rng)) + "\n")
        at += n


if __name__ == "__main__":
    main()
