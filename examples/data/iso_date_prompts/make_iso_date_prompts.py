"""Write the iso_date_prompts dataset: GRPO prompts with their reference answers.

    python examples/data/iso_date_prompts/make_iso_date_prompts.py

Each line is one of the 320 chats of ``examples/data/iso_dates/train.jsonl`` as
TRL's GRPO records have it: the user's request as a conversational ``prompt`` and
the assistant's ``YYYY-MM-DD`` reply as ``answer``, the column the
``exact_match`` reward compares with. Deterministic: running the script again
writes the same file.
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "iso_dates", "train.jsonl")


def prompt(chat: dict) -> dict:
    """``{prompt, answer}`` of one iso_dates chat."""
    user, reply = chat["messages"]
    return {"prompt": [user], "answer": reply["content"]}


def main() -> None:
    with open(SOURCE, encoding="utf-8") as f:
        chats = [json.loads(line) for line in f]
    out = os.path.join(HERE, "train.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(prompt(chat)) + "\n")


if __name__ == "__main__":
    main()
