"""A Llama-style decoder sized by `LlamaConfig`: RMSNorm, SwiGLU MLP, rotary position embeddings,
grouped-query attention when `kv_heads < heads`, no biases, an untied LM head.

Rotary tables are non-persistent buffers of the top-level model (one copy shared by every layer);
`init_weights()` recomputes them, so a model built on meta and materialized elsewhere is whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import AutoparError
from autopar.models.sizes import check_positive, check_sizes


@dataclass(kw_only=True, slots=True)
class LlamaConfig:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 0               # 0 means heads (multi-head attention); fewer means GQA
    ffn: int = 0                    # SwiGLU width; 0 means Llama's rule (8/3 * hidden, rounded to 256)
    seq: int = 4096
    vocab: int = 32000
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        check_sizes("llama", self, required=("layers", "hidden", "heads", "seq", "vocab"),
                    optional=("kv_heads", "ffn"))
        check_positive("llama", self, ("rope_theta", "norm_eps"))
        if self.kv_heads == 0:
            self.kv_heads = self.heads
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise AutoparError(f"llama hidden={self.hidden} must split into heads={self.heads} "
                               f"heads of an even size (rotary embeddings rotate pairs)")
        if self.heads % self.kv_heads:
            raise AutoparError(f"llama heads={self.heads} is not a multiple of kv_heads="
                               f"{self.kv_heads}; grouped-query attention shares each kv head "
                               f"among a whole number of query heads")
        if self.ffn == 0:
            self.ffn = 256 * math.ceil(int(8 * self.hidden / 3) / 256)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.kv_heads != self.heads:
            group = self.heads // self.kv_heads
            k, v = (t[:, :, None].expand(batch, self.kv_heads, group, seq, self.head_dim)
                    .reshape(batch, self.heads, seq, self.head_dim) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """`model(input_ids [batch, seq] int64) -> logits [batch, seq, vocab]`."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.register_buffer("rope_cos", torch.empty(cfg.seq, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.seq, cfg.head_dim), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """N(0, 0.02) weights, output projections scaled by 1/sqrt(2 * layers), unit norms, and
        the rotary tables. Deterministic under `torch.manual_seed`."""
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attn.wo", "ffn.w2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        cfg = self.config
        device = self.rope_cos.device
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.seq, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        with torch.no_grad():
            self.rope_cos.copy_(angles.cos())
            self.rope_sin.copy_(angles.sin())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_emb(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
