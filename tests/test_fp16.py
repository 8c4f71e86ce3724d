"""fp16 mixed precision with dynamic loss scaling on real gloo ranks: losses against a single-process
`torch.autocast` fp16 run with fp32 master weights and torch's GradScaler, an overflow on one rank
skipping the step on every rank, and the scaler's state through a checkpoint."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: each would import it again)
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autopar
from autopar.cost.config import Config
from autopar.plans import Plan
from autopar.solver.planner import at_precision
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.testing.equivalence import mismatches, train_single_process

SPEC = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"
# rotary positions: tables computed in fp32 inside each stage
ROTARY = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=8,vocab=64"
BATCH = 8
FORMS = {"dp": Config(dp=2, global_batch=BATCH, micro_batch=4),
         "zero-3": Config(dp=2, zero=3, global_batch=BATCH, micro_batch=4),
         "tp": Config(tp=2, global_batch=BATCH, micro_batch=BATCH),
         "pp": Config(pp=2, global_batch=BATCH, micro_batch=4)}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def batches(steps):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (BATCH, 8), generator=generator),
             torch.randint(0, 64, (BATCH, 8), generator=generator)) for _ in range(steps)]


def new_model(spec: str = SPEC):
    return build_model(spec, device="cpu", seed=3)[0]


def compiled(config: Config | Plan, data, precision: str = "fp16", spec: str = SPEC):
    """Mixed-precision training under a Config (planned at that precision) or a Plan (of another
    precision, priced again at it)."""
    micro = config.micro_batch if isinstance(config, Config) else config.micro_batch_size
    return autopar.compile(new_model(spec), f"{config.world_size}:cpu", loss_fn=lm_loss, optimizer=adamw,
                           plan=config, example_inputs=(data[0][0][:micro],), precision=precision)


def poison_next_check(cm) -> None:
    """Make rank 0's first local gradient inf just before the next inf check: only rank 0 holds
    it (a shard under ZeRO and TP, a stage's own parameter under PP)."""
    real = cm.scaler.unscale_

    def unscale(optimizer):
        cm.scaler.unscale_ = real
        if dist.get_rank() == 0:
            grad = next(p.grad for group in optimizer.param_groups for p in group["params"]
                        if p.grad is not None)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local[(0,) * local.dim()] = float("inf")
        real(optimizer)
    cm.scaler.unscale_ = unscale


def autocast_reference(data, dtype: torch.dtype, spec: str = SPEC):
    """One process under torch.autocast with fp32 master weights; fp16 with torch's GradScaler.
    Returns the losses and the final scale (None for bf16)."""
    def autocast_call(model, inputs):
        with torch.autocast("cpu", dtype=dtype):
            return model(*inputs)

    def autocast_loss(logits, targets):
        with torch.autocast("cpu", dtype=dtype):
            return lm_loss(logits, targets)

    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    losses = train_single_process(new_model(spec), data, autocast_loss, adamw, call=autocast_call,
                                  scaler=scaler)[0]
    return losses, None if scaler is None else scaler.get_scale()


def train_mixed(forms: dict, precision: str = "fp16", spec: str = SPEC) -> dict:
    data = batches(4)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    reference, scale = autocast_reference(data, dtype, spec)
    fp32 = train_single_process(new_model(spec), data, lm_loss, adamw)
    results = {"fp32 vs reference": [abs(a - b) for a, b in zip(fp32[0], reference)],
               "reference scale": scale}
    for name, config in forms.items():
        cm = compiled(config, data, precision, spec)
        outputs = []   # what each stage computes: its outputs' dtypes
        for stage in cm.stages:
            stage.register_forward_hook(lambda _m, _a, out, seen=outputs: seen.extend(
                t.dtype for t in (out if isinstance(out, tuple) else (out,)) if t.is_floating_point()))
        losses = [cm.step(ids, targets) for ids, targets in data]
        results[name] = {"differences": [abs(a - b) for a, b in zip(losses, reference)],
                         "dtypes": {p.dtype for p in cm.stages.parameters()},
                         "outputs": set(outputs),
                         "scale": None if cm.scaler is None else cm.scaler.get_scale(),
                         "stage_class": type(getattr(cm.schedule, "_stages", [cm.schedule])[0]).__name__,
                         "skipped": cm.skipped_steps,
                         # what crosses to the next stage (the first stage of a pipeline sends)
                         "sent": {x.dtype for p in cm.programs if p.index < len(cm.plan.stages) - 1
                                  for x in p.example_outputs if x.is_floating_point()}}
    return results


@pytest.mark.multiprocess
def test_fp16_tracks_single_process_autocast_with_grad_scaler():
    ranks = autopar.launch(train_mixed, 2, FORMS, timeout=300)
    results = ranks[0]
    # fp16 rounds to 2^-11 relative, 8 times finer than bf16's 2^-8, and the runs round in the
    # same places as the bf16 test's (FSDP2 casts parameters once, autocast on each use; TP sums
    # partial products in another order). The bf16 bound is 1e-3 (five times its spread); fp16's
    # spread is that divided by about 8, so 2e-4 keeps the same margin. A gradient off by a
    # factor 2 moves the loss by 2.8e-3 by step 3, a skipped update by 1.5e-2, an unscaled
    # gradient (65536 times too large) by far more: all caught.
    for name in FORMS:
        found = results[name]
        outputs = set().union(*(rank[name]["outputs"] for rank in ranks))   # the last stage's too
        assert max(found["differences"]) < 2e-4, (name, found["differences"])
        assert found["dtypes"] == {torch.float32}, (name, found["dtypes"])   # fp32 master weights
        assert torch.float16 in outputs, (name, outputs)
        # no overflow at torch's initial scale here, on every rank as in the reference
        assert [rank[name]["scale"] for rank in ranks] == [results["reference scale"]] * 2, name
        assert [rank[name]["skipped"] for rank in ranks] == [0, 0], name


def overflow(forms: dict) -> dict:
    """Steps on batches 0, 1 (poisoned on rank 0), 2 against steps on batches 0, 2 with the scale
    the skip leaves: the skipped step must leave every rank's parameters and optimizer as they
    were, so both runs end equal."""
    data = batches(3)
    results = {}
    for name, config in forms.items():
        cm = compiled(config, data)
        cm.step(*data[0])
        before = cm.full_state_dict()
        scale = cm.scaler.get_scale()
        poison_next_check(cm)
        cm.step(*data[1])
        unchanged = mismatches(([], before), [], cm.full_state_dict(), rtol=0, atol=0)
        skipped = (cm.skipped_steps, cm.scaler.get_scale() == scale / 2)
        last = cm.step(*data[2])
        state = cm.full_state_dict()

        # the same layout as a plan made at fp32, given to compile: priced again at fp16
        graph = autopar.capture(new_model(), (data[0][0][:config.micro_batch],))
        fp32_plan = autopar.plan_from_config(graph, f"{config.world_size}:cpu", config)
        plain = compiled(fp32_plan, data)
        plain.step(*data[0])
        plain.scaler.load_state_dict(cm.scaler.state_dict() | {"scale": scale / 2, "_growth_tracker": 0})
        expected = plain.step(*data[2])
        results[name] = {"unchanged": unchanged, "skipped": skipped,
                         "plans": [(p.precision, p.predicted) for p in (fp32_plan, cm.plan, plain.plan)],
                         "continued": mismatches(([expected], plain.full_state_dict()), [last], state,
                                                 rtol=0, atol=0)}
    return results


# the default tier overflows under ZeRO-3 (FSDP2's sharded gradients); tensor and pipeline
# parallelism's are in the slow tier
@pytest.mark.multiprocess
@pytest.mark.parametrize("names", [("zero-3",), pytest.param(("tp", "pp"), marks=pytest.mark.slow)],
                         ids=["zero-3", "tp-pp"])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(names):
    forms = {name: FORMS[name] for name in names}
    ranks = autopar.launch(overflow, 2, forms, timeout=300)
    for rank, results in enumerate(ranks):
        for name, found in results.items():
            assert found["unchanged"] == [], (rank, name, found["unchanged"])
            assert found["skipped"] == (1, True), (rank, name, found["skipped"])
            assert found["continued"] == [], (rank, name, found["continued"])
            # compile(precision="fp16") plans at fp16 (a Config) or prices a given fp32 plan again
            # at it: the same predictions either way, not the fp32 plan's
            (p32, fp32), (p16, planned), (given, repriced) = found["plans"]
            assert (p32, p16, given) == ("fp32", "fp16", "fp16"), name
            assert planned == repriced, name
            assert planned["memory_breakdown"] != fp32["memory_breakdown"], name


def resume(directory) -> dict:
    """A run saved after 2 steps and resumed in a fresh compile gives the same next losses,
    scale and growth count as the run that went on; and a run whose only step was skipped (its
    optimizer never stepped) saves and resumes too."""
    data = batches(4)
    config = FORMS["zero-3"]
    growing = {"growth_interval": 2}     # the scale doubles every 2 good steps: state that matters
    cm = compiled(config, data)
    cm.scaler.load_state_dict(cm.scaler.state_dict() | growing)
    for batch in data[:2]:
        cm.step(*batch)
    cm.save(directory / "after-2")
    went_on = [cm.step(*batch) for batch in data[2:]]
    resumed = compiled(config, data)
    resumed.load(directory / "after-2")
    loaded_scaler = resumed.scaler.state_dict()
    again = [resumed.step(*batch) for batch in data[2:]]

    first = compiled(config, data)
    poison_next_check(first)
    first.step(*data[0])
    first.save(directory / "skipped")
    later = compiled(config, data)
    later.load(directory / "skipped")
    loaded = (later.steps, later.skipped_steps, later.scaler.get_scale(), not later.optimizer.state)
    fresh = compiled(config, data)      # what the skipped step leaves: the start, at half the scale
    fresh.scaler.update(new_scale=2.0**15)
    skipped = mismatches(([fresh.step(*data[1])], fresh.full_state_dict()), [later.step(*data[1])],
                         later.full_state_dict(), rtol=0, atol=0)
    return {"went on": (went_on, cm.scaler.state_dict(), cm.full_state_dict()),
            "resumed": (again, resumed.scaler.state_dict(), resumed.full_state_dict()),
            "loaded scaler": loaded_scaler, "skipped first": (loaded, skipped)}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fp16_scaler_state_resumes_from_a_checkpoint(tmp_path):
    results = autopar.launch(resume, 2, tmp_path, timeout=300)[0]
    went_on, scaler, state = results["went on"]
    again, resumed_scaler, resumed_state = results["resumed"]
    assert results["loaded scaler"]["scale"] == 2.0**17          # doubled after 2 good steps
    assert results["loaded scaler"]["growth_interval"] == 2
    assert again == went_on
    assert resumed_scaler == scaler
    assert mismatches(([], state), [], resumed_state, rtol=0, atol=0) == []
    loaded, differences = results["skipped first"]
    assert loaded == (1, 1, 2.0**15, True)     # one step taken, skipped: no optimizer state
    assert differences == []


def breakdowns(plan: Plan) -> tuple[dict, dict]:
    return plan.predicted["memory_breakdown"], plan.predicted["breakdown"]


def test_plans_are_priced_at_their_precision():
    """16-bit precisions hold activations and weights in 2 bytes; gradients stay fp32 (FSDP2
    accumulates and reduces them in fp32); under data parallelism FSDP's sharded fp32 parameters
    are the master weights the optimizer steps beside Adam's moments (12 bytes per parameter in
    either precision), which ZeRO-1 splits over dp = 2. fp16 is priced as bf16: the same bytes,
    and the device tables give both the same FLOP/s."""
    model, (ids,) = build_model(SPEC, device="meta", batch=4)
    graph = autopar.capture(model, (ids,))
    cpu = autopar.plan_from_config(graph, "2:cpu", Config(dp=2, zero=1, global_batch=8, micro_batch=4))
    assert cpu.precision == "fp32"                 # a CPU trains in fp32 unless told
    fp16, bf16 = at_precision(graph, cpu, "fp16"), at_precision(graph, cpu, "bf16")
    assert (fp16.precision, bf16.precision, cpu.precision) == ("fp16", "bf16", "fp32")
    assert fp16.predicted == bf16.predicted
    (memory32, time32), (memory16, time16) = breakdowns(cpu), breakdowns(fp16)
    params = memory32["weights"] / 4
    assert memory16["weights"] == memory32["weights"] / 2 == 2 * params
    assert memory16["gradients"] == memory32["gradients"]
    assert memory16["optimizer"] == memory32["optimizer"] == 12 * params / 2
    # floating activations halve; token ids and attention's fp32 log-sum-exp keep their size
    assert memory32["activations"] / 2 <= memory16["activations"] < memory32["activations"]
    assert fp16.predicted["memory_per_gpu_bytes"] < cpu.predicted["memory_per_gpu_bytes"]
    assert time16["exposed_comm"] < time32["exposed_comm"]        # weights gathered in 2 bytes
    assert at_precision(graph, fp16, "fp32").predicted == cpu.predicted   # and back

    gpu = autopar.plan_from_config(graph, "1x8:a100-80g", Config(dp=8, zero=1, global_batch=32,
                                                                  micro_batch=4))
    assert gpu.precision == "bf16"                 # a GPU trains in bf16 unless told
    fp32 = at_precision(graph, gpu, "fp32")
    # an A100's fp32 matmuls run at 19.5 TFLOP/s, its 16-bit ones at 312
    assert breakdowns(fp32)[1]["compute"] > 2 * breakdowns(gpu)[1]["compute"]
    assert breakdowns(fp32)[0]["weights"] == 2 * breakdowns(gpu)[0]["weights"]
    planned = autopar.plan_from_config(graph, "1x8:a100-80g", Config(dp=8, zero=1, global_batch=32,
                                                                      micro_batch=4), precision="fp32")
    assert planned.precision == "fp32" and planned.predicted == fp32.predicted


def test_unknown_precision_is_refused():
    model, (ids,) = build_model(SPEC, device="meta", batch=4)
    with pytest.raises(autopar.AutoparError, match="precision='fp8'.*bf16"):
        autopar.compile(model, "1:cpu", example_inputs=(ids,), loss_fn=lm_loss, optimizer=adamw,
                        precision="fp8")


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision, dtype, bound", [
    ("fp16", torch.float16, 2e-4), pytest.param("bf16", torch.bfloat16, 1e-3, marks=pytest.mark.slow)])
def test_pipeline_of_data_parallel_stages_sends_16_bit_values(precision, dtype, bound):
    """FSDP2 casts a stage's parameters to 16 bits, so its outputs are 16-bit where autocast
    alone keeps the residual stream in fp32; the next stage's receive buffers come from the
    split's record of what crosses, so both sides must agree on the dtype (they did not: the
    stages received garbage, and fp16 skipped every step on the infs). Values cross in 16 bits,
    as Megatron-LM sends them and the cost model prices them."""
    forms = {"pp x dp": Config(pp=2, dp=2, zero=1, global_batch=BATCH, micro_batch=2)}
    ranks = autopar.launch(train_mixed, 4, forms, precision, timeout=300)
    found = ranks[0]["pp x dp"]
    # the bounds of the 2-rank tests, for the same reasons
    assert max(found["differences"]) < bound, (precision, found["differences"])
    assert found["sent"] == {dtype}, (precision, found["sent"])
    assert [rank["pp x dp"]["skipped"] for rank in ranks] == [0] * 4, precision


@pytest.mark.multiprocess
def test_a_rotary_model_pipelined_in_bf16_trains_like_one_process_under_autocast():
    """A stage of a rotary model takes 16-bit values from the one before and computes its rotary
    tables in fp32, which only autocast reconciles. The split's fake run that records what
    crosses between stages ran without autocast, so every pipeline of such a model under mixed
    precision (every GPU plan of Llama with pp > 1) was refused when built ("Expected query, key,
    and value to have the same dtype"). It runs as training does now."""
    forms = {"pp x dp": Config(pp=2, dp=2, zero=1, global_batch=BATCH, micro_batch=2)}
    ranks = autopar.launch(train_mixed, 4, forms, "bf16", ROTARY, timeout=300)
    found = ranks[0]["pp x dp"]
    assert max(found["differences"]) < 1e-3, found["differences"]    # the bf16 bound above
    assert found["sent"] == {torch.bfloat16}, found["sent"]


@pytest.mark.multiprocess
def test_zero_bubble_data_parallel_stages_fold_16_bit_gradients_as_they_are_made():
    """Under a zero-bubble schedule the weight gradients come after FSDP2's post-backward hook,
    so each 16-bit gradient stayed beside its fp32 accumulation until the next micro-batch
    (2 more bytes a parameter). autopar's stage folds them after each weight backward
    (runtime.schedule.WeightBackwardStage): the same sums in the same order, so training still
    tracks one process."""
    forms = {"pp x dp": Config(pp=2, dp=2, zero=1, global_batch=BATCH, micro_batch=2,
                               schedule="zero-bubble")}
    ranks = autopar.launch(train_mixed, 4, forms, "bf16", timeout=300)
    found = ranks[0]["pp x dp"]
    assert max(found["differences"]) < 1e-3, found["differences"]    # the bf16 bound above
    assert found["stage_class"] == "WeightBackwardStage"


@pytest.mark.multiprocess
def test_ring_attention_passes_16_bit_blocks_and_trains_like_one_process():
    """The ring passes the keys and values as they come (16 bits under mixed precision, the kv
    heads before grouped-query attention repeats them) and their gradients in fp32; it computes
    in fp32. It had passed every block in fp32 after the repeat (a Llama 70B rank sent 16x the
    bytes). Training still tracks one process under autocast."""
    forms = {"cp2": Config(cp=2, global_batch=BATCH, micro_batch=BATCH)}
    ranks = autopar.launch(train_mixed, 2, forms, "bf16", ROTARY, timeout=300)
    assert max(ranks[0]["cp2"]["differences"]) < 1e-3, ranks[0]["cp2"]["differences"]
