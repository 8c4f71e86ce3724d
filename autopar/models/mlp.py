"""A stack of residual MLP blocks: the smallest model with repeated blocks and real matmuls.

`model(x [batch, hidden] float) -> [batch, hidden]`; train it against a target with MSE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.models.sizes import check_sizes


@dataclass(kw_only=True, slots=True)
class MLPConfig:
    layers: int = 4
    hidden: int = 1024
    ffn: int = 0                    # inner width; 0 means 4 * hidden

    def __post_init__(self):
        check_sizes("mlp", self, required=("layers", "hidden"), optional=("ffn",))
        if self.ffn == 0:
            self.ffn = 4 * self.hidden


class MLPBlock(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(MLPBlock(cfg) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.hidden, cfg.hidden)

    def init_weights(self) -> None:
        """torch's default initialization of every layer, in module order (seed first to repeat)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm)):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
