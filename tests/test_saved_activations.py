"""What the estimator keeps for the backward is what autograd keeps: the storages its saved
tensors hold, counted on a module run once in fp32 under `saved_tensors_hooks`."""

import torch
from torch import nn

import autopar
from autopar.cost.layout import infer_layout


class GatedExperts(nn.Module):
    """GPT-OSS's expert activation on a bias added in place, a ReLU and tanh branch, and an RMS
    norm: ops that save nothing (an in-place add), their result (sigmoid, relu, tanh, rsqrt),
    their inputs, or the input a weight's gradient needs (the norm's weight)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64, bias=False)
        self.bias = nn.Parameter(torch.randn(64))
        self.down = nn.Linear(32, 16)
        self.norm = nn.Parameter(torch.randn(16))

    def forward(self, x):
        hidden = self.up(x)
        hidden.add_(self.bias)
        gate, linear = hidden[..., :32], hidden[..., 32:]
        gate = gate.clamp(max=7.0)
        glu = gate * torch.sigmoid(gate * 1.702)
        mixed = (linear.clamp(-7.0, 7.0) + 1) * glu
        out = self.down(torch.relu(mixed) + torch.tanh(mixed))
        # an RMS norm's weight keeps the normalized rows for its gradient
        return self.norm * (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6))


def autograd_kept_bytes(model: nn.Module, x: torch.Tensor) -> int:
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() != x.untyped_storage().data_ptr():
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x)
    return sum(kept.values())


def test_kept_activations_are_autograds_saved_storages():
    torch.manual_seed(0)
    model, x = GatedExperts(), torch.randn(4, 8, 16)
    layout = infer_layout(autopar.capture(model, (x[:1],)), 1, compute_dtype="float32")
    keys = {key for node in layout.nodes for key in node.saved}
    # the input itself is the model's, not an activation it makes
    predicted = sum(layout.storage_bytes[key] for key in keys if key in layout.storage_bytes
                    and layout.storage[key] == key and not key.startswith("x")) * x.shape[0]
    assert predicted == autograd_kept_bytes(model, x)
