"""Models for ``hvdc bench e2e`` on synthetic inputs of the right shapes.

* ``transformer`` (11.6M parameters, 53 tensors): a 4-layer pre-norm
  Transformer language model, vocabulary 16384, width 256, 4 heads, MLP 1024,
  sequence 32, batch 4 per rank -- two large matrices (embedding and output
  head, 4.2M each), sixteen mid-sized ones and many small biases and norms,
  as real models have.
* ``matrix2000``: one 2000x2000 weight (4M parameters), a linear layer on a
  batch of 16 -- the single-gradient case the method issues measure.
* ``tiny``: a 2-layer MLP (about 70k parameters) for tests of the benchmark itself.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, WIDTH, LAYERS, HEADS, MLP, SEQ, BATCH = 16384, 256, 4, 4, 1024, 32, 4
MODELS = ("transformer", "matrix2000", "tiny")


class TinyLM(nn.Module):
    """Decoder-only Transformer LM with untied embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, MLP, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


class MatrixModel(nn.Module):
    """One ``n x n`` linear layer regressed onto a fixed random target map."""

    def __init__(self, n: int = 2000) -> None:
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.randn(n, n) / n ** 0.5)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((x @ self.weight.T - y) ** 2).mean()


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.net(x) - y) ** 2).mean()


def build_model(name: str) -> Any:
    """A fresh model ``name`` (seed torch first for identical weights on every rank)."""
    if name == "transformer":
        return TinyLM()
    if name == "matrix2000":
        return MatrixModel(2000)
    if name == "tiny":
        return TinyMLP()
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def synthetic_batch(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: random tokens (LM) or Gaussian inputs, seeded by (rank, step)."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    if name == "transformer":
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    if name == "matrix2000":
        x = torch.randn(16, 2000, generator=g)
        return x, torch.roll(x, 1, dims=1)
    if name == "tiny":
        x = torch.randn(32, 64, generator=g)
        return x, x.flip(1)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")
