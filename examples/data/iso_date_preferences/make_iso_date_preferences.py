"""Write the iso_date_preferences dataset: the ISO answer preferred to a US-style one.

    python examples/data/iso_date_preferences/make_iso_date_preferences.py

Each line is a preference pair in TRL's conversational format, built from the first
160 chats of ``examples/data/iso_dates/train.jsonl``: the user's request as
``prompt``, the assistant's ``YYYY-MM-DD`` answer as ``chosen``, and the same date
written ``MM/DD/YYYY`` (the form the request did not ask for) as ``rejected``.
Deterministic: running the script again writes the same file.
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "iso_dates", "train.jsonl")
PAIRS = 160


def pair(chat: dict) -> dict:
    """``{prompt, chosen, rejected}`` message lists of one iso_dates chat."""
    user, reply = chat["messages"]
    y, m, d = reply["content"].split("-")
    wrong = {"role": "assistant", "content": f"{m}/{d}/{y}"}
    return {"prompt": [user], "chosen": [reply], "rejected": [wrong]}


def main() -> None:
    with open(SOURCE, encoding="utf-8") as f:
        chats = [json.loads(line) for line in f][:PAIRS]
    out = os.path.join(HERE, "train.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(pair(chat)) + "\n")


if __name__ == "__main__":
    main()
