"""A model built on meta, loaded from safetensors onto 4 CPU ranks: peak memory per rank.

    python benchmarks/meta_load.py [--layers 12] [--hidden 768] [--vocab 50304] [--steps 2]

The default GPT has ~163M parameters: fp32 weights and Adam's two moments take ~2 GB. Three runs,
each in its own process so that each peak is its own:
1. writer: builds the model with real weights and saves them to one safetensors file;
2. one process: the model built on meta, `load_state_dict(assign=True)` from the file (one
   copy), AdamW steps; its peak resident memory (VmHWM);
3. 4 gloo ranks: `autopar.compile(meta model, load_from=file)` under ZeRO-3 (dp=4) or
   dp=2 x tp=2 with ZeRO-3 (`--form dp-tp`); every rank compares its shards with the file's
   slices (each element of the model is held by exactly one rank under dp=4: the check covers
   the whole state), takes the same steps, and reports its peak resident memory.
Resident memory includes torch's own (~0.2-0.3 GB after import) and heap the allocator keeps after
freeing, so the table shows the resident size after import, and the peak of live tensors during
the steps (`autopar.testing.memory.LiveBytes`) beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork, which would each import it)

import autopar
from autopar.cost.config import Config
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.testing.memory import LiveBytes, rank_tensors

FORMS = {"zero3": Config(dp=4, zero=3, global_batch=4, micro_batch=1),
         "dp-tp": Config(dp=2, tp=2, zero=3, global_batch=4, micro_batch=2)}


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmHWM: peak resident, VmRSS: resident now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def spec(args) -> str:
    return (f"gpt:layers={args.layers},hidden={args.hidden},heads={args.hidden // 64},"
            f"seq={args.seq},vocab={args.vocab}")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def batch(args, rows: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (rows, args.seq), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def write(args, path: str) -> None:
    from safetensors.torch import save_file

    model = build_model(spec(args), device="cpu")[0]
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)


def one_process(args, path: str) -> dict:
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    baseline = status_kib("VmRSS")
    model = build_model(spec(args), device="meta")[0]
    model.load_state_dict(load_file(path), assign=True)
    optimizer = adamw(list(model.parameters()))
    ids, targets = batch(args, FORMS[args.form].global_batch)
    with LiveBytes(list(model.parameters())) as tensors:
        for _ in range(args.steps):
            lm_loss(model(ids), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"baseline_kib": baseline, "peak_kib": status_kib("VmHWM"), "tensor_peak": tensors.peak}


def on_rank(args, path: str) -> dict:
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from autopar.runtime.materialize import local_region
    from autopar.passes.program import TensorRef

    baseline = status_kib("VmRSS")
    config = FORMS[args.form]
    ids, targets = batch(args, config.global_batch)
    cm = autopar.compile(build_model(spec(args), device="meta")[0], "4:cpu", loss_fn=lm_loss,
                         optimizer=adamw, plan=config, example_inputs=(ids[:config.micro_batch],),
                         load_from=path)
    after_load = status_kib("VmHWM")
    mismatched, held = [], 0
    refs = [r for r in cm.stages.modules() if isinstance(r, TensorRef)]
    with safe_open(path, framework="pt") as handle, torch.no_grad():
        for ref in refs:
            local = ref.value.to_local() if isinstance(ref.value, DTensor) else ref.value
            held += local.numel() if isinstance(ref.value, torch.nn.Parameter) else 0
            if not torch.equal(local, handle.get_slice(ref.fqn)[local_region(ref.value)]):
                mismatched.append(ref.fqn)
    with LiveBytes(rank_tensors(cm)) as tensors:
        losses = [cm.step(ids, targets) for _ in range(args.steps)]
    return {"baseline_kib": baseline, "after_load_kib": after_load, "peak_kib": status_kib("VmHWM"),
            "tensor_peak": tensors.peak,
            "mismatched": mismatched, "elements_held": held, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--form", choices=sorted(FORMS), default="zero3")
    parser.add_argument("--role", choices=["main", "write", "single"], default="main")
    parser.add_argument("--path", default="")
    args = parser.parse_args()
    if args.role == "write":
        return write(args, args.path)
    if args.role == "single":
        print(json.dumps(one_process(args, args.path)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.safetensors")
        flags = [f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "vocab", "seq", "steps", "form")]
        subprocess.run([sys.executable, __file__, "--role=write", f"--path={path}", *flags], check=True)
        single = json.loads(subprocess.run([sys.executable, __file__, "--role=single", f"--path={path}",
                                            *flags], check=True, capture_output=True, text=True).stdout)
        ranks = autopar.launch(on_rank, 4, args, path, timeout=1800, pg_timeout=600)
        params = sum(t.numel() for t in build_model(spec(args), device="meta")[0].parameters())
    gib = 2**20
    print(f"model {spec(args)}: {params / 1e6:.1f}M parameters, fp32 weights + Adam "
          f"{params * 12 / 1e9:.2f} GB; form {args.form} {FORMS[args.form]}")
    print(f"{'process':<12}{'after import':>14}{'peak after load':>17}{'peak after steps':>18}"
          f"{'tensor peak in steps':>22}")
    print(f"{'one process':<12}{single['baseline_kib'] / gib:>12.2f}G{'':>17}{single['peak_kib'] / gib:>17.2f}G"
          f"{single['tensor_peak'] / 2**30:>21.2f}G")
    for rank, result in enumerate(ranks):
        print(f"{'rank ' + str(rank):<12}{result['baseline_kib'] / gib:>12.2f}G"
              f"{result['after_load_kib'] / gib:>16.2f}G{result['peak_kib'] / gib:>17.2f}G"
              f"{result['tensor_peak'] / 2**30:>21.2f}G")
    mismatched = sorted({name for r in ranks for name in r["mismatched"]})
    held = sum(r["elements_held"] for r in ranks)
    print(f"loaded shards equal to the file: {not mismatched} {mismatched[:4]}; elements held over "
          f"ranks {held} (model {params}{', each once' if held == params else ''})")
    print(f"losses per step: {[round(x, 4) for x in ranks[0]['losses']]}")


if __name__ == "__main__":
    main()
