"""autopar on GPUs: the data-parallel step against torch DDP over NCCL, the numerics of each
parallel form against one GPU with predicted against measured step time and memory, and the MFU of
a one-GPU step against plain eager PyTorch.

    python benchmarks/gpu_check.py --device h100-80g                        # one GPU
    torchrun --nproc-per-node 8 benchmarks/gpu_check.py --device h100-80g   # 8 GPUs
    torchrun --nproc-per-node 2 benchmarks/gpu_check.py --device cpu --layers 1 --hidden 64 \\
        --seq 16 --steps 2                                                  # the script itself, on gloo

1. Data parallel on every GPU of the run (one GPU too: DDP's and autopar's machinery over a world
   of one): `autopar.compile(plan=Config(dp=N))` against `DistributedDataParallel`, and, as the
   baseline of what autopar builds on, torch's own FSDP2 `replicate` (one group per block, then the
   model) against DDP. Steps of the two alternate after a warm-up, each after a barrier and ended
   by `torch.cuda.synchronize`; printed: the median over pairs of (first step / DDP step), each
   side's median milliseconds, and the largest relative loss difference (fp32, TF32 off, SGD: the
   runs are the same computation; reductions in another order differ by ~1e-6).
2. With several GPUs, each form the world size allows (dp, ZeRO-3, tp, dp x tp, pp x dp) against
   rank 0's one-GPU training: losses within 1e-4 relative, the median step time and the peak of
   `torch.cuda.max_memory_allocated` beside the estimator's predictions for the named device.
3. On one GPU, bf16: autopar's compiled step against the same eager loop under autocast, and each
   one's MFU (forward and backward FLOPs of the captured graph over the device's peak).
4. On rank 0, context parallelism's ring blocks: the fused kernel a block runs on the device (CUDA's
   memory-efficient attention, fp32) against the plain products, forward and backward, with the
   backward given the log-sum-exp of a whole attention over two blocks (as the ring's is).
5. On rank 0, the experts' grouped matmul (one grouped GEMM on a GPU) against a loop of fp32
   matmuls, forward and gradients, in bf16.
6. On rank 0, autopar::attention (soft-capped scores and sinks) in fp32 on the device against
   fp64 on the CPU, forward and gradients.
`--device cpu` runs 1, 2, 4, 5 and 6 on gloo CPU ranks (times then say nothing about GPUs): it checks the
script itself where no GPU is lent. Needs torch and autopar only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

TOLERANCE = 1e-4


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def timed_steps(step, steps: int, device: torch.device, warmup: int = 2) -> tuple[float, int | None, list]:
    """(median step seconds, peak bytes allocated on a GPU, losses) of `steps` calls after `warmup`."""
    losses = [step() for _ in range(warmup)]
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak_bytes(device), losses


def race(first, second, steps: int, device: torch.device, warmup: int = 2) -> dict:
    """Alternate steps of two contenders after `warmup` pairs: each side's median seconds, the
    median of the per-pair ratios (first / second), the largest relative loss difference."""
    times: dict[str, list[float]] = {"first": [], "second": []}
    losses: dict[str, list[float]] = {"first": [], "second": []}
    for index in range(warmup + steps):
        for name, step in (("first", first), ("second", second)):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            losses[name].append(step())
            synchronize(device)
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(times["first"], times["second"])]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["first"], losses["second"]))
    return {"first": statistics.median(times["first"]), "second": statistics.median(times["second"]),
            "ratio": statistics.median(ratios), "loss_difference": worst}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def hand_step(model, inputs: torch.Tensor, targets: torch.Tensor):
    """A hand-written training step on this rank's rows; returns the loss averaged over ranks,
    as autopar's step returns it."""
    from autopar.models.gpt import lm_loss

    opt = sgd(list(model.parameters()))

    def step() -> float:
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / dist.get_world_size()
    return step


def check_data_parallel(args, spec: str, device: torch.device, mesh) -> None:
    import autopar
    from autopar.cost.config import Config
    from autopar.models import build_model
    from autopar.models.gpt import lm_loss
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    world, rank = dist.get_world_size(), dist.get_rank()
    ids, targets = batch(args, device)
    rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
    config = Config(dp=world, global_batch=args.batch, micro_batch=args.batch // world)
    # fp32 as DDP's model trains (a GPU plan's default precision is bf16): the same computation
    cm = autopar.compile(build_model(spec, device=device)[0], mesh, loss_fn=lm_loss, optimizer=sgd,
                         plan=config, example_inputs=(ids[rows],), precision="fp32")
    # each race starts both contenders from the same initial weights: a DDP model the first race
    # trained would be steps ahead of the second race's fresh one
    ddp = lambda: DistributedDataParallel(build_model(spec, device=device)[0],
                                          device_ids=[device.index] if device.type == "cuda" else None)
    by_hand = build_model(spec, device=device)[0]
    replica_mesh = init_device_mesh(device.type, (world,))
    for layer in by_hand.layers:
        replicate(layer, mesh=replica_mesh)
    replicate(by_hand, mesh=replica_mesh)
    rows_step = lambda model: hand_step(model, ids[rows], targets[rows])
    results = {"autopar dp vs DDP": race(lambda: cm.step(ids, targets), rows_step(ddp()), args.steps, device),
               "torch FSDP2 replicate vs DDP (baseline)": race(rows_step(by_hand), rows_step(ddp()),
                                                                args.steps, device)}
    if rank == 0:
        for name, r in results.items():
            print(f"{name} on {world} x {args.device}: ratio {r['ratio']:.3f} (median over step pairs; "
                  f"{r['first'] * 1e3:.1f} ms vs {r['second'] * 1e3:.1f} ms), losses differ by "
                  f"{r['loss_difference']:.1e} relative", flush=True)


def batch(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return ids.to(device), torch.roll(ids, -1, dims=1).to(device)


def forms(world: int, batch_size: int) -> dict:
    from autopar.cost.config import Config

    candidates = {"dp": Config(dp=world, global_batch=batch_size, micro_batch=batch_size // world),
                  "zero-3": Config(dp=world, zero=3, global_batch=batch_size, micro_batch=batch_size // world),
                  "tp": Config(tp=world, global_batch=batch_size, micro_batch=batch_size),
                  "dp x tp": Config(dp=world // 2, tp=2, global_batch=batch_size,
                                    micro_batch=batch_size // max(1, world // 2)),
                  "pp x dp": Config(pp=2, dp=world // 2, global_batch=batch_size,
                                    micro_batch=max(1, batch_size // world // 2))}
    return {name: c for name, c in candidates.items() if c.world_size == world and world > 1}


def check_forms(args, spec: str, device: torch.device, mesh) -> None:
    import autopar
    from autopar.cost.plan_estimate import estimate_plan
    from autopar.models import build_model
    from autopar.models.gpt import lm_loss

    world, rank = dist.get_world_size(), dist.get_rank()
    ids, targets = batch(args, device)
    reference = [None]
    if rank == 0:          # one device's training, the reference of every form
        model = build_model(spec, device=device)[0]
        opt = sgd(list(model.parameters()))

        def step():
            loss = lm_loss(model(ids), targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        reference[0] = timed_steps(step, args.steps, device)[2]
        del model, opt
    dist.broadcast_object_list(reference, src=0)
    for name, config in forms(world, args.batch).items():
        example = (ids[:config.micro_batch],)
        graph = autopar.capture(build_model(spec, device="meta")[0], (example[0].cpu(),))
        # fp32 as the reference trains (a GPU's default precision is bf16)
        cm = autopar.compile(build_model(spec, device=device)[0], mesh, loss_fn=lm_loss, optimizer=sgd,
                             plan=config, example_inputs=example, graph=graph, precision="fp32")
        seconds, peak, losses = timed_steps(lambda: cm.step(ids, targets), args.steps, device)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference[0]))
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        predicted = estimate_plan(graph, cm.plan)      # the plan the ranks run, as it was priced
        memory = "n/a on CPU" if peak is None else f"{max(peaks) / 2**30:.2f} GiB"
        if rank == 0:
            print(f"{name:<8} losses vs one device: max rel {worst:.1e} "
                  f"({'ok' if worst <= TOLERANCE else 'MISMATCH'}); step {seconds * 1e3:.1f} ms "
                  f"(predicted {predicted.step_time_s * 1e3:.1f}); peak {memory} "
                  f"(predicted {predicted.memory_per_gpu_bytes / 2**30:.2f} GiB)", flush=True)
        del cm


def check_mfu(args, spec: str, device: torch.device, mesh) -> None:
    """One GPU, bf16: autopar's compiled step against the same eager loop, and each one's MFU."""
    import autopar
    from autopar.cost.config import Config
    from autopar.models import build_model
    from autopar.models.gpt import lm_loss

    ids, targets = batch(args, device)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True)
    model = build_model(spec, device=device)[0]
    opt = adamw(list(model.parameters()))

    def eager():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(model(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    eager_s = timed_steps(eager, args.steps, device)[0]
    del model, opt
    graph = autopar.capture(build_model(spec, device="meta")[0], (ids.cpu(),))
    cm = autopar.compile(build_model(spec, device=device)[0], mesh, loss_fn=lm_loss, optimizer=adamw,
                         graph=graph, example_inputs=(ids,), precision="bf16",
                         plan=Config(global_batch=args.batch, micro_batch=args.batch))
    compiled_s, peak, _ = timed_steps(lambda: cm.step(ids, targets), args.steps, device)
    flops = 3 * graph.forward_flops          # forward and backward of one step
    peak_flops = mesh.device.flops("bfloat16")
    print(f"single GPU bf16 {spec}: eager {eager_s * 1e3:.1f} ms, MFU {flops / eager_s / peak_flops:.1%}; "
          f"autopar {compiled_s * 1e3:.1f} ms, MFU {flops / compiled_s / peak_flops:.1%} "
          f"(ratio {compiled_s / eager_s:.2f}); peak {peak / 2**30:.2f} GiB")


def check_ring_blocks(device: torch.device) -> None:
    """Check 4: each ring block's kernel against plain products: a causal 40 x 40 block and a
    40 x 72 one (40 rows: the CUDA kernel pads its log-sum-exp to a multiple of 32)."""
    from autopar.passes.context_attention import _attend, _attend_backward, _merge, has_kernel

    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator).to(device)
    worst = 0.0
    for rows, keys, causal in ((40, 40, True), (40, 72, False)):
        q, grad = make(2, 4, rows, 64), make(2, 4, rows, 64)
        blocks = [(make(2, 4, keys, 64), make(2, 4, keys, 64)) for _ in range(2)]
        outs = [_attend(q, k, v, causal, 0.125, kernel=False) for k, v in blocks]
        out, lse = _merge(*outs[0], *outs[1], slice(None))      # the whole attention's
        for (k, v), plain in zip(blocks, outs):
            fused = _attend(q, k, v, causal, 0.125, kernel=has_kernel(device))
            worst = max(worst, *(float((a - b).abs().max()) for a, b in zip(fused, plain)))
            for a, b in zip(_attend_backward(grad, q, k, v, out, lse, causal, 0.125, kernel=True),
                            _attend_backward(grad, q, k, v, out, lse, causal, 0.125, kernel=False)):
                worst = max(worst, float((a - b).abs().max()))
    verdict = "ok" if worst <= TOLERANCE else "DIFFERS"
    print(f"ring attention blocks on {device.type}: fused kernel vs plain products, largest "
          f"difference {worst:.2e} (forward, log-sum-exp, gradients): {verdict}")


def check_grouped_experts(device: torch.device) -> None:
    """Check 5: the experts' grouped matmul (autopar.models.experts.grouped_mm: one
    torch._grouped_mm on a GPU, its backward on the weights transposed as a view, column-major)
    against a loop of fp32 matmuls, forward and both gradients, with an expert that got no rows."""
    from autopar.models.experts import grouped_mm

    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator).to(device, torch.bfloat16)
    rows, weight = make(96, 64).requires_grad_(), make(4, 64, 128).requires_grad_()
    ends = torch.tensor([16, 16, 64, 96], device=device)
    out = grouped_mm(rows, weight, ends)
    grad = make(*out.shape)
    out.backward(grad)
    plain_rows = rows.detach().float().requires_grad_()
    plain_weight = weight.detach().float().requires_grad_()
    starts = [0, *ends.tolist()[:-1]]
    plain = torch.cat([plain_rows[a:b] @ plain_weight[e] for e, (a, b) in enumerate(zip(starts, ends.tolist()))])
    plain.backward(grad.float())
    worst = max(float((a.detach().float() - b.detach()).abs().max() / b.detach().abs().max())
                for a, b in ((out, plain), (rows.grad, plain_rows.grad), (weight.grad, plain_weight.grad)))
    verdict = "ok" if worst <= 2e-2 else "DIFFERS"
    print(f"grouped expert matmul on {device.type} (bf16) vs fp32 loop: largest difference "
          f"{worst:.2e} of the largest value (forward, gradients): {verdict}")


def check_capped_attention(device: torch.device) -> None:
    """Check 6: autopar::attention (soft-capped scores, sinks: Gemma 2's and GPT-OSS's attention)
    on the device in fp32 against the same op in fp64 on the CPU, forward and gradients (queries,
    keys, values, sinks), causal, over 300 queries: tiles of query rows where the device cuts them."""
    from autopar.models import capped_attention  # noqa: F401  (registers autopar::attention)

    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 4, 300, 64)] * 3 + [(4,)]
    given = [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in shapes]
    grad = torch.randn(2, 4, 300, 64, generator=generator, dtype=torch.float64)
    results = []
    for where, dtype in ((device, torch.float32), (torch.device("cpu"), torch.float64)):
        inputs = [t.to(where, dtype).requires_grad_() for t in given]
        out = torch.ops.autopar.attention(*inputs[:3], None, 0.0, True, 0.125, 30.0, inputs[3])
        out.backward(grad.to(where, dtype))
        results.append([t.detach().cpu().double() for t in (out, *(x.grad for x in inputs))])
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*results))
    verdict = "ok" if worst <= TOLERANCE else "DIFFERS"
    print(f"autopar::attention on {device.type} (fp32, softcap and sinks) vs fp64 on the CPU: "
          f"largest difference {worst:.2e} of the largest value (forward, gradients): {verdict}")


def run(args) -> None:
    """Every check this world runs; the default process group is up."""
    import autopar

    cpu = args.device == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    if not cpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    mesh = autopar.Mesh.parse(f"{dist.get_world_size()}:{args.device}")
    spec = (f"gpt:layers={args.layers},hidden={args.hidden},heads={max(1, args.hidden // 64)},"
            f"seq={args.seq},vocab=1024")
    check_data_parallel(args, spec, device, mesh)
    if dist.get_world_size() > 1:
        check_forms(args, spec, device, mesh)
    elif not cpu:
        check_mfu(args, spec, device, mesh)
    if dist.get_rank() == 0:
        check_ring_blocks(device)
        check_grouped_experts(device)
        check_capped_attention(device)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100-80g",
                        help="autopar device spec of these GPUs, or cpu to check the script on gloo")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16, help="global batch (a multiple of the ranks)")
    parser.add_argument("--steps", type=int, default=5)
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device is visible; run it on a machine with GPUs "
                 "(torchrun --nproc-per-node N benchmarks/gpu_check.py), or with --device cpu")
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        os.environ.setdefault(key, value)        # a plain `python` run is a world of one
    world = int(os.environ["WORLD_SIZE"])
    if args.batch % world:
        sys.exit(f"gpu_check: --batch {args.batch} is not a multiple of the {world} ranks")
    if not cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("gloo" if cpu else "nccl")
    run(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
