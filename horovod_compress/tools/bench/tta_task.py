"""The task of ``hvdc bench tta``: a byte-level GPT on the Python standard library's own sources.

Every machine with Python has the corpus, so the benchmark needs no download:
the ``.py`` files under :func:`sysconfig.get_paths` ``["stdlib"]`` (third-party
``site-packages``/``dist-packages`` excluded), sorted by path. The split is by
file and deterministic: a file is validation text when the CRC-32 of its path
relative to the library root is 0 mod :data:`VAL_EVERY`, training text otherwise,
so no line of a validation file is ever trained on, and every rank and every
run sees the same split.

Tokens are bytes (vocabulary 256), so the cross-entropy in nats per token is
nats per byte and the quality is **bits per byte**, ``bpb = loss / ln 2``
(the measure of byte-level language models, e.g. Radford et al. 2019,
"Language Models are Unsupervised Multitask Learners", Table 3's enwik8/text8
columns). A model that knows nothing scores ``log2(256) = 8`` bits per byte.

The model is a pre-norm decoder-only Transformer (Radford et al. 2018/2019,
GPT-2 section 2.3: layer norm moved to each block's input, a final one after
the last block) with learned positions and an untied output head.
"""
from __future__ import annotations

import math
import sysconfig
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

#: One file in this many (by CRC-32 of its relative path) is validation text.
VAL_EVERY = 10
VOCAB = 256


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the byte-level GPT and of a rank's batch."""
    width: int
    layers: int
    heads: int
    seq: int
    batch: int

    @property
    def mlp(self) -> int:
        return 4 * self.width


#: ``gpt``: 6.4M parameters (8 blocks of width 256; a 25.8 MB float32 gradient per step), one
#: 64-byte window per rank and step (``hvdc bench tta --batch`` changes it);
#: ``tiny``: 0.1M parameters, for tests of the benchmark itself.
MODELS: dict[str, GPTConfig] = {
    "gpt": GPTConfig(width=256, layers=8, heads=4, seq=64, batch=1),
    "tiny": GPTConfig(width=48, layers=2, heads=2, seq=32, batch=4),
}


def bits_per_byte(loss_nats: float) -> float:
    """Cross-entropy per byte in nats -> bits per byte (divide by ln 2)."""
    return loss_nats / math.log(2.0)


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(relative: str) -> bool:
    """Whether the file at ``relative`` (path under the library root, '/'-separated) is validation text."""
    return zlib.crc32(relative.encode()) % VAL_EVERY == 0


def corpus_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, validation files) under ``root`` (default the stdlib), each sorted by path."""
    root = root or stdlib_root()
    train, val = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        (val if is_validation(rel) else train).append(path)
    if not train or not val:
        raise ValueError(f"no Python sources found under {root} (need both a training and a validation file)")
    return train, val


def read_bytes(files: list[Path], limit: int | None = None) -> np.ndarray:
    """The files' bytes, concatenated in order (a newline between files), at most ``limit`` bytes."""
    parts, total = [], 0
    for f in files:
        data = f.read_bytes() + b"\n"
        parts.append(data)
        total += len(data)
        if limit is not None and total >= limit:
            break
    return np.frombuffer(b"".join(parts)[:limit], dtype=np.uint8)


def train_batch(data: np.ndarray, cfg: GPTConfig, seed: int, rank: int, step: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: ``cfg.batch`` random windows of ``cfg.seq + 1`` bytes,
    the offsets drawn from a generator seeded by (seed, rank, step) -- the same on every run."""
    rng = np.random.default_rng([seed, rank, step])
    starts = rng.integers(0, len(data) - cfg.seq - 1, size=cfg.batch)
    windows = np.stack([data[s:s + cfg.seq + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(windows)
    return t[:, :-1], t[:, 1:]


def validation_windows(data: np.ndarray, cfg: GPTConfig, count: int, rank: int, size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of ``count`` fixed, evenly spaced validation windows (rank r takes
    windows r, r + size, ...), so the ranks together score every window once."""
    starts = np.linspace(0, len(data) - cfg.seq - 2, count).astype(np.int64)[rank::size]
    windows = np.stack([data[s:s + cfg.seq + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(windows)
    return t[:, :-1], t[:, 1:]


class ByteGPT(nn.Module):
    """Pre-norm decoder-only Transformer over bytes (GPT-2 layout, untied head)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.width)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.width) * 0.02)
        layer = nn.TransformerEncoderLayer(cfg.width, cfg.heads, cfg.mlp, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[:tokens.shape[1]]
        h = self.blocks(h, mask=self.mask[:tokens.shape[1], :tokens.shape[1]], is_causal=True)
        return self.head(self.norm(h))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in nats per byte."""
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


def model_config(name: str, batch: int | None = None) -> GPTConfig:
    """``MODELS[name]``, with ``batch`` windows per rank and step when given."""
    cfg = MODELS[name]
    if batch is None:
        return cfg
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return replace(cfg, batch=batch)


def build_gpt(name: str) -> ByteGPT:
    """A fresh model of size ``name`` (seed torch first for identical weights on every rank)."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return ByteGPT(MODELS[name])


def parameter_count(model: Any) -> int:
    return int(sum(p.numel() for p in model.parameters()))
