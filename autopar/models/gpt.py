"""A hand-written GPT (GPT-2/GPT-3 architecture) sized by `GPTConfig`.

Learned position embeddings, pre-LayerNorm blocks, GELU MLP, an untied LM head (a separate
`lm_head` weight keeps the embedding and the head independently shardable), attention through
`F.scaled_dot_product_attention(is_causal=True)`. Query, key and value are separate linears by
default: each is then column-parallel on its own, where a fused qkv output would have to be
split after sharding (Megatron interleaves heads for that); `fused_qkv=True` gives one linear.
Weights are `nn.Linear`'s [out, in] layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import AutoparError
from autopar.models.sizes import check_sizes


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    seq: int = 2048
    vocab: int = 51200
    ffn: int = 0                    # MLP width; 0 means 4 * hidden
    dropout: float = 0.0
    bias: bool = True
    fused_qkv: bool = False

    def __post_init__(self):
        check_sizes("gpt", self, required=("layers", "hidden", "heads", "seq", "vocab"),
                    optional=("ffn",))
        if self.hidden % self.heads:
            raise AutoparError(f"gpt hidden={self.hidden} is not divisible by heads={self.heads}; "
                               f"choose a hidden size that is a multiple of the head count")
        if not 0.0 <= self.dropout < 1.0:
            raise AutoparError(f"gpt dropout={self.dropout} must be in [0, 1)")
        if self.ffn == 0:
            self.ffn = 4 * self.hidden


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.fused_qkv = cfg.fused_qkv
        if cfg.fused_qkv:
            self.wqkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        else:
            self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
            self.wk = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
            self.wv = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        if self.fused_qkv:
            q, k, v = self.wqkv(x).split(hidden, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        head_dim = hidden // self.heads
        q, k, v = (t.view(batch, seq, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, hidden)
        return self.resid_dropout(self.wo(y))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """`model(input_ids [batch, seq] int64) -> logits [batch, seq, vocab]`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.hidden)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.norm_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers),
        zero biases, unit norms. Deterministic under `torch.manual_seed`; a no-op cost on meta."""
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attn.wo", "mlp.fc2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device)
        x = self.emb_dropout(self.tok_emb(input_ids) + self.pos_emb(positions))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; `targets` are the input ids shifted by the caller."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
