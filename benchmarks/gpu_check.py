"""autopar on GPUs: numerics of each form against one GPU, predicted against measured step time
and peak memory, and the MFU of a single-GPU step against plain eager PyTorch.

    torchrun --nproc-per-node 8 benchmarks/gpu_check.py --device h100-80g   # forms on 8 GPUs
    python benchmarks/gpu_check.py --device h100-80g                        # one GPU: MFU only

Forms (each needing a world size it divides): dp, ZeRO-3, tp, dp x tp, pp x dp. Numerics in fp32
(TF32 off) with SGD against rank 0's single-GPU training of the same model on the same batches:
losses within 1e-4 relative (GPU reductions are not ordered as on one device). Time is the median
of the timed steps after warm-up, each ended by `torch.cuda.synchronize`; memory is
`torch.cuda.max_memory_allocated` over the timed steps. The predictions are the estimator's for
the same config on the named device (`autopar.estimate(..., precision="fp32")`).
Exits with a message where CUDA is absent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

TOLERANCE = 1e-4


def timed_steps(step, steps: int, warmup: int = 2) -> tuple[float, int, list[float]]:
    """(median step seconds, peak bytes allocated, losses) of `steps` calls after `warmup`."""
    losses = [step() for _ in range(warmup)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated(), losses


def forms(world: int, batch: int) -> dict:
    from autopar.cost.config import Config

    candidates = {"dp": Config(dp=world, global_batch=batch, micro_batch=batch // world),
                  "zero-3": Config(dp=world, zero=3, global_batch=batch, micro_batch=batch // world),
                  "tp": Config(tp=world, global_batch=batch, micro_batch=batch),
                  "dp x tp": Config(dp=world // 2, tp=2, global_batch=batch, micro_batch=batch // (world // 2)),
                  "pp x dp": Config(pp=2, dp=world // 2, global_batch=batch,
                                    micro_batch=max(1, batch // world // 2))}
    return {name: c for name, c in candidates.items() if c.world_size == world and world > 1}


def check_forms(args, spec: str) -> None:
    import torch.distributed as dist

    import autopar
    from autopar.cost.plan_estimate import tensor_placements
    from autopar.models import build_model
    from autopar.models.gpt import lm_loss

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = (ids.to(device), torch.roll(ids, -1, dims=1).to(device))
    reference = [None]
    if rank == 0:          # one GPU's training, the reference of every form
        model = build_model(spec, device=device)[0]
        opt = sgd(list(model.parameters()))

        def step():
            loss = lm_loss(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        reference[0] = timed_steps(step, args.steps)[2]
        del model, opt
    dist.broadcast_object_list(reference, src=0)
    mesh = autopar.Mesh.parse(f"{world}:{args.device}")
    for name, config in forms(world, args.batch).items():
        example = (batch[0][:config.micro_batch],)
        graph = autopar.capture(build_model(spec, device="meta")[0], (example[0].cpu(),))
        cm = autopar.compile(build_model(spec, device=device)[0], mesh, loss_fn=lm_loss, optimizer=sgd,
                             plan=config, example_inputs=example, graph=graph)
        seconds, peak, losses = timed_steps(lambda: cm.step(*batch), args.steps)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference[0]))
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        placements = tensor_placements(graph, cm.plan)      # what the compiled plan runs
        predicted = autopar.estimate(graph, mesh, config, precision="fp32", placements=placements)
        if rank == 0:
            print(f"{name:<8} losses vs one GPU: max rel {worst:.1e} "
                  f"({'ok' if worst <= TOLERANCE else 'MISMATCH'}); step {seconds * 1e3:.1f} ms "
                  f"(predicted {predicted.step_time_s * 1e3:.1f}); peak {max(peaks) / 2**30:.2f} GiB "
                  f"(predicted {predicted.memory_per_gpu_bytes / 2**30:.2f})", flush=True)
        del cm


def check_mfu(args, spec: str) -> None:
    """One GPU, bf16: autopar's compiled step against the same eager loop, and each one's MFU."""
    import autopar
    from autopar.cost.config import Config
    from autopar.models import build_model
    from autopar.models.gpt import lm_loss

    device = torch.device("cuda", torch.cuda.current_device())
    ids = torch.randint(0, 1024, (args.batch, args.seq), device=device)
    targets = torch.roll(ids, -1, dims=1)
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
    eager_s = timed_steps(eager, args.steps)[0]
    del model, opt
    mesh = autopar.Mesh.parse(f"1:{args.device}")
    graph = autopar.capture(build_model(spec, device="meta")[0], (ids.cpu(),))
    cm = autopar.compile(build_model(spec, device=device)[0], mesh, loss_fn=lm_loss, optimizer=adamw,
                         graph=graph, example_inputs=(ids,), precision="bf16",
                         plan=Config(global_batch=args.batch, micro_batch=args.batch))
    compiled_s, peak, _ = timed_steps(lambda: cm.step(ids, targets), args.steps)
    flops = 3 * graph.forward_flops          # forward and backward of one step
    peak_flops = mesh.device.flops("bfloat16")
    print(f"single GPU bf16 {spec}: eager {eager_s * 1e3:.1f} ms, MFU {flops / eager_s / peak_flops:.1%}; "
          f"autopar {compiled_s * 1e3:.1f} ms, MFU {flops / compiled_s / peak_flops:.1%} "
          f"(ratio {compiled_s / eager_s:.2f}); peak {peak / 2**30:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100-80g", help="autopar device spec of these GPUs")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device is visible; run it on a machine with GPUs "
                 "(torchrun --nproc-per-node N benchmarks/gpu_check.py)")
    import torch.distributed as dist

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        os.environ.setdefault(key, value)        # a plain `python` run is a world of one
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("nccl")
    spec = f"gpt:layers={args.layers},hidden={args.hidden},heads={args.hidden // 64},seq={args.seq},vocab=1024"
    if dist.get_world_size() == 1:
        check_mfu(args, spec)
    else:
        check_forms(args, spec)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
