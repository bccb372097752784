"""A small character corpus generated from a seed (no downloads), and deterministic batches of it.

Each line is one task with learnable structure: addition ("417+86=503"), copy ("copy kqzt|kqzt"),
reversal ("rev abcd|dcba") and sorting ("sort dbca|abcd"). The text is a pure function of the
seed, and the batch of step s is a pure function of (seed, s), so runs with the same seed see the
same data and a resumed run continues exactly where it stopped.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = "\n +=|0123456789" + LETTERS
STOI = {c: i for i, c in enumerate(VOCAB)}


def _line(rng: random.Random) -> str:
    task = rng.randrange(4)
    if task == 0:
        a, b = rng.randrange(1000), rng.randrange(1000)
        return f"{a}+{b}={a + b}"
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8)))
    if task == 1:
        return f"copy {word}|{word}"
    if task == 2:
        return f"rev {word}|{word[::-1]}"
    return f"sort {word}|{''.join(sorted(word))}"


def generate_text(seed: int, num_chars: int) -> str:
    """At least num_chars characters of newline-separated task lines."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < num_chars:
        line = _line(rng)
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


def encode(text: str) -> torch.Tensor:
    return torch.tensor([STOI[c] for c in text], dtype=torch.int64)


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[i] for i in ids.tolist())


@dataclass
class CharCorpus:
    """Token stream of generate_text(seed, num_chars); batch(step) samples windows from it."""

    seed: int
    num_chars: int = 200_000

    def __post_init__(self) -> None:
        self.tokens = encode(generate_text(self.seed, self.num_chars))

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of `step`: inputs and next-character targets, each [batch_size, seq_len]."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - seq_len - 1, (batch_size,), generator=g)
        windows = torch.stack([self.tokens[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
