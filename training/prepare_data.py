"""Build the training corpus from installed Debian packages: data/{train,heldout}.jsonl.

Each line is {"source": "fortunes" | "python_docs" | "chat", "text": ...}. Fortunes and documentation
chunks are split into train and held-out by a hash of their text (stable across runs and machines); the
synthetic chats are built from training-split fortunes only, so held-out fortunes never leak into them.
Run: .venv/bin/python training/prepare_data.py   (needs: apt-get install fortunes fortunes-min python3-doc)
"""

from __future__ import annotations

import json
import random
import zlib

import chat_data
import sources
from recipe import DATA_DIR, HELDOUT_FRACTION, NUM_SYNTHETIC_CHATS, SEED


def is_heldout(text: str) -> bool:
    return zlib.crc32(text.encode("utf-8")) % 10_000 < HELDOUT_FRACTION * 10_000


def main() -> None:
    rng = random.Random(SEED)
    fortunes = sources.read_fortunes()
    train_fortunes = {cat: [t for t in texts if not is_heldout(t)] for cat, texts in fortunes.items()}
    docs = sources.read_python_docs()
    chats = chat_data.make_chats(train_fortunes, chat_data.python_docstrings(), NUM_SYNTHETIC_CHATS, rng)

    records = [("fortunes", t) for texts in fortunes.values() for t in texts]
    records += [("python_docs", t) for t in docs]
    records += [("chat", chat_data.render_chat(messages)) for messages in chats]
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    counts: dict[str, list[int]] = {}
    with open(DATA_DIR / "train.jsonl", "w") as train, open(DATA_DIR / "heldout.jsonl", "w") as heldout:
        for source, text in records:
            held = is_heldout(text)
            (heldout if held else train).write(json.dumps({"source": source, "text": text}) + "\n")
            counts.setdefault(source, [0, 0, 0])
            counts[source][held] += 1
            counts[source][2] += len(text)
    for source, (n_train, n_held, chars) in counts.items():
        print(f"{source:12s} train {n_train:6d}  heldout {n_held:5d}  chars {chars:,}")


if __name__ == "__main__":
    main()
