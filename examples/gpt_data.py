"""Byte-level token windows over a text that ships with the repository (no downloads).

    from gpt_data import TokenDataset, VOCAB_SIZE
    data = TokenDataset.from_text(block_size=64)          # examples/data/tiny_corpus.txt
    x, y = data[0]                                        # int64 [64] each; y is x shifted by one

Tokens are the text's bytes (vocabulary 256), so the same file always gives the same tokens.
Window i starts at byte i * stride and holds block_size + 1 tokens: x is its first block_size,
y its last block_size (the next-token targets). With the default stride == block_size the
windows do not overlap, and every window lies wholly inside the text.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 256
CORPUS = Path(__file__).parent / "data" / "tiny_corpus.txt"


def load_tokens(path: str | Path = CORPUS) -> torch.Tensor:
    """The file's bytes as int64 tokens."""
    raw = bytearray(Path(path).read_bytes())
    return torch.frombuffer(raw, dtype=torch.uint8).to(torch.int64)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class TokenDataset:
    """Fixed-length (x, y) windows over a 1-D token tensor; a map-style dataset."""

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride or block_size
        if block_size < 1 or self.stride < 1:
            raise ValueError("block_size and stride must be positive")
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for one window of "
                             f"{block_size + 1}")

    @classmethod
    def from_text(cls, path: str | Path = CORPUS, block_size: int = 64,
                  stride: int | None = None) -> TokenDataset:
        return cls(load_tokens(path), block_size, stride)

    def split(self, val_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """(train, val): the text's first part and its tail, cut between tokens, not windows,
        so no window straddles the two."""
        cut = int(len(self.tokens) * (1 - val_fraction))
        return (TokenDataset(self.tokens[:cut], self.block_size, self.stride),
                TokenDataset(self.tokens[cut:], self.block_size, self.stride))

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.stride
        window = self.tokens[start:start + self.block_size + 1]
        # clones: a batch must not keep the whole token tensor alive through views
        return window[:-1].clone(), window[1:].clone()
