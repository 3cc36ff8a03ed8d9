"""The synthetic corpus the ``tiny-trained`` checkpoint learned (``train.py``), and what
the bench, the CLI's demo and the tests draw in-distribution prompts from."""

from __future__ import annotations

import torch

TRAINED_PHRASES = 48  # phrases of the corpus the shipped checkpoint was trained on


def corpus(vocab: int, seed: int, phrases: int = TRAINED_PHRASES) -> "Corpus":
    """The trained checkpoint's corpus (its phrases and successors), sampled from ``seed``."""
    return Corpus(vocab, phrases, torch.Generator().manual_seed(seed))


class Corpus:
    """Sequences mixing two learnable processes over tokens 2..vocab-1:

    - arithmetic runs ``a, a+s, a+2s, ...`` (mod the range), stride s in 1..5;
    - phrase chains: fixed random phrases (3..8 tokens) where phrase k is mostly
      followed by phrase ``succ[k]``.
    """

    def __init__(self, vocab: int, phrases: int, gen: torch.Generator):
        self.vocab, self.gen = vocab, gen
        self.phrases = [torch.randint(2, vocab, (int(torch.randint(3, 9, (1,), generator=gen)),),
                                      generator=gen).tolist() for _ in range(phrases)]
        self.succ = torch.randperm(phrases, generator=gen).tolist()

    def _int(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=self.gen))

    def sample(self, length: int) -> list[int]:
        out: list[int] = []
        while len(out) < length:
            if self._int(0, 2) == 0:  # an arithmetic run
                a, s, n = self._int(0, self.vocab - 2), self._int(1, 6), self._int(6, 20)
                out += [2 + (a + s * i) % (self.vocab - 2) for i in range(n)]
            else:  # a phrase chain
                k = self._int(0, len(self.phrases))
                for _ in range(self._int(2, 6)):
                    out += self.phrases[k]
                    k = self.succ[k] if self._int(0, 10) < 8 else self._int(0, len(self.phrases))
        return out[:length]

    def batch(self, n: int, length: int) -> torch.Tensor:
        return torch.tensor([self.sample(length) for _ in range(n)])  # [n, length]
