"""Norms over a dimension that tensor parallelism splits compute what one process computes.

OLMo2 normalizes its queries and keys with an RMSNorm over the whole projection (all heads at
once), so under tensor parallelism the norm reads a value whose last dim the column-parallel
projection splits. The plan gathers it first (or sums partial sums of squares), never normalizing
a shard. In fp32 OLMo2's parameters after 3 AdamW steps differ from one process by up to ~1.2e-5
of their scale (dp2 x tp2, the embedding) where Llama's differ by ~2e-6: rounding, not a wrong
computation. The distributed run sums some products in another order (the value projection is
row-parallel here: two partial sums all-reduced; input gradients of the split projections are
summed over ranks), and OLMo2 amplifies rounding: one process in fp32 is itself 1.5e-5 away from
the same training in float64 (Llama: 2.6e-6, Qwen2: 1.7e-6; measured on this machine). The proof is
float64: there the distributed run and one process agree to ~1e-15, so they compute the same
function, and a norm computed on a shard would differ by far more than 1e-12.
"""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork)
import torch.distributed as dist

import autopar
from autopar.cost.config import Config
from autopar.testing.equivalence import mismatches, train_single_process

pytest.importorskip("transformers")
from autopar.models.hf_zoo import ARCHITECTURES, loss_fn, resolve  # noqa: E402

pytestmark = pytest.mark.multiprocess

CLASSES = resolve(["olmo2"])
GLOBAL_BATCH, STEPS = 8, 3


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def build(dtype: torch.dtype):
    return ARCHITECTURES["olmo2"].build(CLASSES["olmo2"]).to(dtype)


def train_at(config: Config, dtypes: list[torch.dtype]) -> dict:
    """On every rank: OLMo2 under `config` at each dtype; rank 0 reports the differences from one
    process at the same dtype: the standard tolerance's mismatches, and the largest difference
    relative to each tensor's scale."""
    generator = torch.Generator().manual_seed(1)
    data = [ARCHITECTURES["olmo2"].batch(GLOBAL_BATCH, generator) for _ in range(STEPS)]
    example = tuple(x[:config.micro_batch] for x in data[0][:-1])
    found = {}
    for dtype in dtypes:
        cm = autopar.compile(build(dtype), f"{config.world_size}:cpu", example_inputs=example,
                             loss_fn=loss_fn, optimizer=adamw, plan=config)
        losses = [cm.step(*batch) for batch in data]
        state = cm.full_state_dict()
        if dist.get_rank() == 0:
            reference = train_single_process(build(dtype), data, loss_fn, adamw)
            relative = max(((state[k].double() - v.double()).abs().max() / v.double().abs().max()).item()
                           for k, v in reference[1].items() if v.is_floating_point() and v.abs().max() > 0)
            losses_off = max(abs(a - b) / abs(b) for a, b in zip(losses, reference[0]))
            found[str(dtype)] = {"mismatches": mismatches(reference, losses, state),
                                 "relative": max(relative, losses_off)}
    return found


def check(found: dict) -> None:
    assert found["torch.float64"]["relative"] < 1e-12, found
    assert found["torch.float32"]["mismatches"] == [], found


@pytest.mark.slow
def test_qk_norms_over_the_whole_projection_under_dp_x_tp_are_exact_in_float64():
    config = Config(dp=2, tp=2, micro_batch=4, global_batch=GLOBAL_BATCH)
    check(autopar.launch(train_at, 4, config, [torch.float64, torch.float32], timeout=400)[0])


@pytest.mark.slow
def test_qk_norms_over_the_whole_projection_under_pp_x_tp_x_dp_are_exact_in_float64():
    config = Config(pp=2, tp=2, dp=2, micro_batch=2, global_batch=GLOBAL_BATCH)
    check(autopar.launch(train_at, 8, config, [torch.float64, torch.float32], timeout=600)[0])
