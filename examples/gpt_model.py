"""A GPT-style decoder defined in the repo: the benchmark model and the README's example model.

Depends on torch only, so the example, the benchmark harness and the tests share one definition.

Reference size "1.3B" (the benchmark issue's recipe, exactly): 24 layers, hidden 2048, 16 heads,
vocab 32,000, sequence 2,048, learned position embedding, pre-LayerNorm blocks with causal
`scaled_dot_product_attention`, bias-free linears, GELU (tanh) MLP of width 4 x hidden, untied
output head: 1,343,426,560 parameters.

Other sizes: "tiny" (CPU tests), "125M", "350M", "2.7B", "7B". The non-reference names are nominal
(vocab 32,000 and an untied head make them a little larger than the GPT-3 models they echo);
`count_parameters` gives the exact number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "GPT",
    "SIZES",
    "get_config",
    "count_parameters",
    "flops_per_token",
    "SyntheticTokens",
]


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int = 32_000
    seq_len: int = 2_048
    # The per-GPU micro batch the benchmark uses for this size (sequences, not tokens).
    micro_batch: int = 8
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=512, seq_len=64, micro_batch=4),
    "125M": GPTConfig(n_layer=12, d_model=768, n_head=12),
    "350M": GPTConfig(n_layer=24, d_model=1024, n_head=16),
    "1.3B": GPTConfig(n_layer=24, d_model=2048, n_head=16),
    "2.7B": GPTConfig(n_layer=32, d_model=2560, n_head=32, micro_batch=4),
    "7B": GPTConfig(n_layer=32, d_model=4096, n_head=32, micro_batch=1),
}


def get_config(size: str, **overrides: int) -> GPTConfig:
    """The named size, with optional field overrides (e.g. a shorter `seq_len` for a test)."""
    if size not in SIZES:
        raise KeyError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    return replace(SIZES[size], **overrides) if overrides else SIZES[size]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, s, d) -> (b, heads, s, head_dim): the layout SDPA's fused kernels take.
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """`model(idx)` -> logits; `model(idx, targets)` -> mean cross-entropy loss (fp32).

    The blocks are a `ModuleList` named `blocks`: FSDP2 wraps each element and zerorun's stage 3
    forms one parameter group per element.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)
        so the residual stream's variance does not grow with depth."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.cfg.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        s = idx.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence length {s} exceeds the model's {self.cfg.seq_len}")
        pos = torch.arange(s, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        # fp32 loss whatever the compute dtype, as autocast does, so every benchmark
        # configuration computes the same loss.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def count_parameters(cfg: GPTConfig) -> int:
    """Exact parameter count without building the model."""
    d, L, V, S = cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.seq_len
    per_block = 12 * d * d + 2 * (2 * d)  # qkv 3d², proj d², MLP 8d²; two LayerNorms (w, b)
    return L * per_block + V * d + S * d + 2 * d + V * d  # + tok_emb, pos_emb, ln_f, head


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward, no activation recomputation).

        F = 72·L·d² + 12·L·s·d + 6·V·d

    Megatron-LM's formula (Narayanan et al., 2021, eq. 3 without recomputation) per token:
    72·L·d² is 6 × the 12·L·d² weights of the blocks' matmuls (2 FLOPs per multiply-add, ×3 for
    forward + the two backward matmuls); 12·L·s·d is attention (Q·Kᵀ and attention·V, each
    2·s·d per token per layer forward, ×3 for training); 6·V·d is the output head. Embedding
    lookups, LayerNorms, GELU and softmax are not counted. The causal mask is not discounted:
    flash kernels skip about half of the attention work, the convention (PaLM, Megatron) counts
    it all, so MFU here is comparable with published figures.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    L, d, V = cfg.n_layer, cfg.d_model, cfg.vocab_size
    return 72.0 * L * d * d + 12.0 * L * s * d + 6.0 * V * d


class SyntheticTokens:
    """Learnable synthetic token batches, generated on the device, reproducible per step.

    Each sequence repeats a random motif of 8..64 tokens drawn from a Zipf-like distribution
    over the vocabulary. A model first learns the unigram skew (the loss falls quickly below
    ln V) and then to copy the motif (an induction pattern; the loss heads towards 0), so a few
    steps already show whether every configuration learns the same.

    `batch(step)` depends only on (seed, rank, step): every configuration sees identical data
    whatever it did before, and ranks see different data.
    """

    _MIN_MOTIF, _MAX_MOTIF = 8, 64

    def __init__(
        self, cfg: GPTConfig, batch_size: int, device: torch.device | str, seed: int = 1234, rank: int = 0
    ) -> None:
        self.vocab_size, self.seq_len, self.batch_size = cfg.vocab_size, cfg.seq_len, batch_size
        self.device = torch.device(device)
        self.seed, self.rank = seed, rank
        ranks = torch.arange(1, cfg.vocab_size + 1, dtype=torch.float32, device=self.device)
        self._probs = 1.0 / ranks
        self._gen = torch.Generator(device=self.device)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 [batch, seq_len]; targets are inputs shifted by one."""
        # Distinct streams per (seed, rank, step): large odd multipliers keep them apart.
        self._gen.manual_seed((self.seed * 1_000_003 + self.rank * 10_007 + step) % (2**63))
        b, n = self.batch_size, self.seq_len + 1
        motif = torch.multinomial(
            self._probs, b * self._MAX_MOTIF, replacement=True, generator=self._gen
        ).view(b, self._MAX_MOTIF)
        period = torch.randint(
            self._MIN_MOTIF, self._MAX_MOTIF + 1, (b, 1), generator=self._gen, device=self.device
        )
        offset = torch.arange(n, device=self.device).unsqueeze(0) % period
        tokens = torch.gather(motif, 1, offset)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
