"""A deterministic, seekable token stream: sample i depends only on (seed, i), so its position is one integer.

Each sequence counts up from a random start by a random stride of 1..4 (mod vocab), with 5% noise tokens:
a small model learns it within tens of steps, so the loss curve visibly falls.
"""

from __future__ import annotations

import torch


class TokenStream:
    def __init__(self, seed: int, vocab: int, seq_len: int) -> None:
        self.seed, self.vocab, self.seq_len = seed, vocab, seq_len

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.vocab, (1,), generator=generator))
        step = int(torch.randint(1, 5, (1,), generator=generator))
        noise = torch.rand(self.seq_len, generator=generator) < 0.05
        tokens = (start + step * torch.arange(self.seq_len)) % self.vocab
        random_tokens = torch.randint(0, self.vocab, (self.seq_len,), generator=generator)
        return torch.where(noise, random_tokens, tokens)

    def batch(self, first: int, count: int) -> torch.Tensor:
        """Samples first .. first + count - 1 as a (count, seq_len) tensor."""
        return torch.stack([self.sample(first + i) for i in range(count)])
