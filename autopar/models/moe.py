"""A mixture-of-experts decoder sized by `MoEConfig`: Mixtral, Qwen3-MoE and DeepSeek-V3 shapes.

Llama's skeleton (RMSNorm, rotary embeddings, SwiGLU, an untied head) with:
  - MoE layers (autopar.models.experts.MoE: top-k routing, dropless, experts as grouped matmuls),
    after `dense_layers` leading dense layers and then every `moe_every`-th layer (HuggingFace's
    rule: layer i is MoE when i >= dense_layers and i % moe_every == 0); shared experts as one
    dense SwiGLU of `shared_experts * shared_ffn` beside the routed ones (DeepSeek's layout);
  - attention with an explicit `head_dim` (Qwen3's 128 at hidden 2048), grouped-query heads and,
    with `qk_norm`, an RMSNorm over each query and key head (Qwen3);
  - or, with `kv_lora` > 0, DeepSeek's multi-head latent attention (MLA): keys and values come
    up from a `kv_lora`-wide compressed vector, queries from a `q_lora`-wide one (a full-rank
    projection when q_lora is 0); each head's query and key are `qk_nope` dims without rotary
    and `qk_rope` with it (the rotary key shared by all heads), values `v_head` dims.
`experts=0` builds every layer dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import AutoparError
from autopar.models.experts import MoE, SwiGLU
from autopar.models.llama import rotate_half
from autopar.models.sizes import check_positive, check_sizes


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 0               # 0 means heads; fewer means grouped-query attention
    head_dim: int = 0               # 0 means hidden / heads
    ffn: int = 0                    # the dense layers' SwiGLU width; 0 means Llama's rule
    seq: int = 4096
    vocab: int = 32000
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    experts: int = 8                # routed experts per MoE layer; 0: every layer dense
    top_k: int = 2                  # experts each token is routed to
    expert_ffn: int = 0             # each expert's SwiGLU width; 0 means ffn
    shared_experts: int = 0         # experts every token runs beside the routed ones
    shared_ffn: int = 0             # each shared expert's width; 0 means expert_ffn
    dense_layers: int = 0           # leading dense layers
    moe_every: int = 1              # after them, an MoE layer at every layer index divisible by it
    qk_norm: bool = False           # RMSNorm over each query and key head (Qwen3)
    q_lora: int = 0                 # MLA: the compressed query's width; 0: a full-rank projection
    kv_lora: int = 0                # MLA (when > 0): the compressed key-value vector's width
    qk_nope: int = 0                # MLA: query/key dims per head without rotary
    qk_rope: int = 0                # MLA: query/key dims per head with rotary
    v_head: int = 0                 # MLA: value dims per head

    def __post_init__(self):
        check_sizes("moe", self, required=("layers", "hidden", "heads", "seq", "vocab", "moe_every"),
                    optional=("kv_heads", "head_dim", "ffn", "experts", "top_k", "expert_ffn",
                              "shared_experts", "shared_ffn", "dense_layers", "q_lora", "kv_lora",
                              "qk_nope", "qk_rope", "v_head"))
        check_positive("moe", self, ("rope_theta", "norm_eps"))
        self.kv_heads = self.kv_heads or self.heads
        self.head_dim = self.head_dim or self.hidden // self.heads
        if self.ffn == 0:
            self.ffn = 256 * math.ceil(int(8 * self.hidden / 3) / 256)
        self.expert_ffn = self.expert_ffn or self.ffn
        self.shared_ffn = self.shared_ffn or self.expert_ffn
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise AutoparError(f"moe top_k={self.top_k} must be from 1 to experts={self.experts}")
        if self.heads % self.kv_heads:
            raise AutoparError(f"moe heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.kv_lora:
            if not (self.qk_nope and self.qk_rope and self.v_head) or self.qk_rope % 2:
                raise AutoparError("moe MLA (kv_lora > 0) needs qk_nope, qk_rope and v_head, with an "
                                   "even qk_rope (rotary embeddings rotate pairs)")
        elif self.q_lora or self.qk_nope or self.qk_rope or self.v_head:
            raise AutoparError("moe q_lora, qk_nope, qk_rope and v_head describe MLA: give kv_lora too")
        elif self.head_dim % 2:
            raise AutoparError(f"moe head_dim={self.head_dim} must be even (rotary embeddings "
                               f"rotate pairs)")

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope if self.kv_lora else self.head_dim

    def is_moe_layer(self, index: int) -> bool:
        return self.experts > 0 and index >= self.dense_layers and index % self.moe_every == 0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention with an explicit head size and optional per-head q/k norms."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        norm = (lambda: nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)) if cfg.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_norm(self.wq(x).view(batch, seq, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(batch, seq, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            group = self.heads // self.kv_heads
            k, v = (t[:, :, None].expand(batch, self.kv_heads, group, seq, self.head_dim)
                    .reshape(batch, self.heads, seq, self.head_dim) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA), as the model config describes it."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim = cfg.heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head
        self.kv_lora, self.q_lora = cfg.kv_lora, cfg.q_lora
        qk = cfg.qk_nope + cfg.qk_rope
        if cfg.q_lora:
            self.wq_a = nn.Linear(cfg.hidden, cfg.q_lora, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora, eps=cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora, cfg.heads * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.hidden, cfg.heads * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden, cfg.kv_lora + cfg.qk_rope, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora, cfg.heads * (cfg.qk_nope + cfg.v_head), bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.v_head, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        query = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        q = query.view(batch, seq, self.heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        compressed, k_rope = self.wkv_a(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(compressed)).view(batch, seq, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k_rope = _rotate(k_rope.unsqueeze(1), cos, sin)        # one rotary key for every head
        q = torch.cat((q_nope, _rotate(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(batch, self.heads, seq, self.rope)), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, self.heads * self.v_dim))


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, index: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.kv_lora else Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        if cfg.is_moe_layer(index):
            shared = cfg.shared_experts * cfg.shared_ffn
            self.ffn = MoE(cfg.hidden, experts=cfg.experts, top_k=cfg.top_k, ffn=cfg.expert_ffn,
                           shared_ffn=shared)
        else:
            self.ffn = SwiGLU(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class MoEModel(nn.Module):
    """`model(input_ids [batch, seq] int64) -> logits [batch, seq, vocab]`."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(MoEBlock(cfg, i) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.register_buffer("rope_cos", torch.empty(cfg.seq, cfg.rotary_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.seq, cfg.rotary_dim), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """N(0, 0.02) weights (experts' too), output projections scaled by 1/sqrt(2 * layers),
        unit norms, and the rotary tables. Deterministic under `torch.manual_seed`."""
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attn.wo", "ffn.w2", "shared.w2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        for name, param in self.named_parameters():
            if ".experts." in f".{name}":
                nn.init.normal_(param, mean=0.0, std=residual_std if name.endswith("w2") else 0.02)
        cfg, device = self.config, self.rope_cos.device
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.rotary_dim, 2, device=device, dtype=torch.float32) / cfg.rotary_dim)
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
