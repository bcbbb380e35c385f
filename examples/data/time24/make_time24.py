"""Write the time24 dataset: clock times written the 12-hour way -> ``HH:MM`` (24-hour).

    python examples/data/time24/make_time24.py   # rewrites train/heldout.jsonl

Each line is a chat: the user asks for a time in 24-hour form, the assistant answers
with ``HH:MM`` only. The skill is a rule (add 12 after noon, 12 AM is 00, zero-pad),
of the same kind as ``iso_dates`` but on other tokens, so the two fine-tunes can be
merged and each scored on its own held-out split. The held-out split has its own
times (no (hour, minute) is in both splits). Seeded: running the script again writes
the same files.
"""

from __future__ import annotations

import json
import os
import random

FORMS = (
    "{h}:{mm} {AP}",  # 3:05 PM
    "{h}:{mm} {ap}",  # 3:05 pm
    "{h}:{mm}{ap}",  # 3:05pm
    "{h}.{mm} {ap}",  # 3.05 pm
    "{mm} past {h} in the {part}",  # 05 past 3 in the afternoon
)
ASKS = (
    "Write this time in 24-hour format (HH:MM): {time}",
    "Convert {time} to 24-hour time.",
    "What is {time} as HH:MM on a 24-hour clock?",
)
SIZES = {"train": 320, "heldout": 80}


def part_of_day(hour: int) -> str:
    """``morning`` (0-11), ``afternoon`` (12-17) or ``evening`` (18-23)."""
    return "morning" if hour < 12 else "afternoon" if hour < 18 else "evening"


def spoken(hour: int, minute: int, form: str) -> str:
    """``hour:minute`` (24-hour) written the 12-hour way in one of `FORMS`."""
    h12 = hour % 12 or 12
    ap = "am" if hour < 12 else "pm"
    return form.format(
        h=h12, mm=f"{minute:02d}", ap=ap, AP=ap.upper(), part=part_of_day(hour)
    )


def example(hour: int, minute: int, rng: random.Random) -> dict:
    """One chat record: question in a random form, answer ``HH:MM``."""
    ask = rng.choice(ASKS).format(time=spoken(hour, minute, rng.choice(FORMS)))
    return {
        "messages": [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": f"{hour:02d}:{minute:02d}"},
        ]
    }


def main() -> None:
    """Draw distinct times of day and write both splits next to this script."""
    rng = random.Random(24)
    times = rng.sample(
        [(h, m) for h in range(24) for m in range(60)], sum(SIZES.values())
    )
    here = os.path.dirname(os.path.abspath(__file__))
    at = 0
    for split, n in SIZES.items():
        with open(os.path.join(here, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for h, m in times[at : at + n]:
                f.write(json.dumps(example(h, m, rng)) + "\n")
        at += n


if __name__ == "__main__":
    main()
