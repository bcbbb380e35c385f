"""Write the initials dataset: a person's full name -> its initials (``M.J.L.``).

    python examples/data/initials/make_initials.py   # rewrites train/heldout.jsonl

Each line is a chat: the user asks for the initials of a name of two or three parts,
the assistant answers with the capital initials, each followed by a dot, and nothing
else. A rule of the same kind as ``iso_dates`` (rewrite the input by a fixed rule) on
other tokens, for merging fine-tunes that each learnt one task. The held-out split
has its own names (no full name is in both splits). Seeded: running the script again
writes the same files.
"""

from __future__ import annotations

import json
import os
import random

FIRST = (
    "Anna Boris Carmen David Elena Farid Grace Hugo Irene Jonas Keiko Liam Maria Nadia "
    "Omar Paula Quentin Rosa Samuel Tara Ugo Vera Walter Ximena Yusuf Zoe"
).split()
MIDDLE = "Alice Bruno Claire Daniel Emma Felix Jane Louis Marie Noel Ruth Sofia".split()
LAST = (
    "Alvarez Brown Chen Dubois Evans Fischer Garcia Hansen Ivanova Jensen Kowalski "
    "Lopez Martin Nguyen Okafor Petrov Quinn Rossi Schmidt Tanaka Urban Varga Weber "
    "Young Zimmer"
).split()
ASKS = (
    "What are the initials of {name}?",
    "Write the initials of this name: {name}",
    "Give the initials (like A.B.) of {name}.",
)
SIZES = {"train": 320, "heldout": 80}


def initials(name: str) -> str:
    """``"Maria Jane Lopez"`` -> ``"M.J.L."``."""
    return "".join(f"{part[0]}." for part in name.split())


def example(name: str, rng: random.Random) -> dict:
    """One chat record: question in a random form, answer the initials."""
    return {
        "messages": [
            {"role": "user", "content": rng.choice(ASKS).format(name=name)},
            {"role": "assistant", "content": initials(name)},
        ]
    }


def main() -> None:
    """Draw distinct names of two or three parts and write both splits."""
    rng = random.Random(36)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < sum(SIZES.values()):
        parts = [rng.choice(FIRST)]
        if rng.random() < 0.5:
            parts.append(rng.choice(MIDDLE))
        parts.append(rng.choice(LAST))
        name = " ".join(parts)
        if name not in seen:
            seen.add(name)
            names.append(name)
    here = os.path.dirname(os.path.abspath(__file__))
    at = 0
    for split, n in SIZES.items():
        with open(os.path.join(here, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for name in names[at : at + n]:
                f.write(json.dumps(example(name, rng)) + "\n")
        at += n


if __name__ == "__main__":
    main()
