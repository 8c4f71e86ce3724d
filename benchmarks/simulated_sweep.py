"""Held-out simulation sweep: HuggingFace architectures outside the zoo x parallel forms, each
rank's simulated peak memory and collective bytes beside what the estimator predicts.

    python benchmarks/simulated_sweep.py [--arch Qwen3,Phi3] [--form "tp2 x pp2, rank 3"]
        [--precision bf16] [--json]

Each case builds the HuggingFace model from transformers (2 layers, or one a chunk;
hidden 256, 4 heads, 2 key/value heads, ffn 512, vocabulary 8192, sequences of 128) on the meta
device, plans the form on 4 CPU ranks (`autopar.api.plan_from_config`), simulates one rank
(`autopar simulate`'s code) and compares. A case passes when memory is within the band of a
cluster plan (-5%..+3%, never under-predicted beyond 3%) and every collective kind's bytes are
within 5% of the priced. `--precision bf16` runs every case in mixed precision (the ranks' own
autocast: the CPU's), where values a stage keeps in fp32 are priced at their own size
(autopar.mixed_dtypes). Prints progress per case, then the table and a summary; exits 1 if any
case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from autopar.cost.config import Config
from autopar.errors import AutoparError
from autopar.models.hf_zoo import Architecture
from autopar.testing.simulated import MEMORY_BAND, simulated_hf

SMALL = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=128, vocab_size=8192)
# transformers model and config classes, and what each needs beyond SMALL
ARCHS = {
    "Qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "Phi3": ("Phi3ForCausalLM", "Phi3Config", {}),
    "StableLm": ("StableLmForCausalLM", "StableLmConfig", {"num_key_value_heads": 4}),
    "Starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {}),
    "Cohere": ("CohereForCausalLM", "CohereConfig", {}),
    "Granite": ("GraniteForCausalLM", "GraniteConfig", {}),
    "Gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {"head_dim": 64}),
    "Olmo": ("OlmoForCausalLM", "OlmoConfig", {"num_key_value_heads": 4}),
    "Glm": ("GlmForCausalLM", "GlmConfig", {"head_dim": 64}),
    "Helium": ("HeliumForCausalLM", "HeliumConfig", {"head_dim": 64}),
    "GraniteMoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig",
                   {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "Glm4Moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                 "first_k_dense_replace": 0, "n_shared_experts": 1, "head_dim": 64}),
    "HunYuanMoE": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config",
                   {"num_experts": 4, "moe_topk": 2, "head_dim": 64}),
}
MOE = {"GraniteMoe", "Glm4Moe", "HunYuanMoE"}
_INTERLEAVED_ZERO_3 = Config(dp=2, pp=2, zero=3, schedule="interleaved-1f1b", virtual=4, global_batch=8)
# form -> (rank simulated, configuration on 4 ranks, for mixtures of experts only)
FORMS = {
    "tp2 x dp2 ZeRO-3": (0, Config(tp=2, dp=2, zero=3, global_batch=4), False),
    "tp2 x pp2, rank 0": (0, Config(tp=2, pp=2, global_batch=4), False),
    "tp2 x pp2, rank 3": (3, Config(tp=2, pp=2, global_batch=4), False),
    "tp4": (1, Config(tp=4, global_batch=4), False),
    "pp2 x dp2 ZeRO-1 full recompute": (0, Config(dp=2, pp=2, zero=1, recompute="full", global_batch=8), False),
    "pp2 x dp2 zero-bubble, rank 2": (2, Config(dp=2, pp=2, schedule="zero-bubble", global_batch=8), False),
    "dp4 ZeRO-2 mbs2": (0, Config(dp=4, zero=2, global_batch=8, micro_batch=2), False),
    "tp2 x dp2 SP selective": (0, Config(tp=2, dp=2, sequence_parallel=True, recompute="selective",
                                         global_batch=4), False),
    "dp4 x ep4": (0, Config(dp=4, ep=4, global_batch=4), True),
    "dp2 x tp2 x ep2": (0, Config(dp=2, tp=2, ep=2, global_batch=4), True),
    "pp2 x dp2 x ep2, rank 3": (3, Config(pp=2, dp=2, ep=2, global_batch=8), True),
    "dp2 x cp2, rank 1": (1, Config(dp=2, cp=2, global_batch=4), False),
    # the attention rerun in the backward, and its head-split swaps with it
    "dp2 x cp2 all-to-all selective, rank 1": (1, Config(dp=2, cp=2, cp_kind="all-to-all",
                                                         recompute="selective", global_batch=4), False),
    "pp2 x dp2 ZeRO-3 interleaved v4, rank 0": (0, _INTERLEAVED_ZERO_3, False),
    "pp2 x dp2 ZeRO-3 interleaved v4, rank 3": (3, _INTERLEAVED_ZERO_3, False),
    # as many micro-batches as pipeline ranks: every forward before the first backward
    "pp2 x dp2 ZeRO-2 interleaved v4, 2 micro-batches, rank 0": (0, Config(
        dp=2, pp=2, zero=2, schedule="interleaved-1f1b", virtual=4, global_batch=4), False),
    "pp2 x dp2 ZeRO-1 interleaved v4, 2 micro-batches, rank 3": (3, Config(
        dp=2, pp=2, zero=1, schedule="interleaved-1f1b", virtual=4, global_batch=4), False),
}
BYTES_TOLERANCE = 0.05
SEQ = 128


def run(arch: str, form: str, precision: str | None = None) -> dict:
    """One case: the rank's simulated and predicted memory, and its bytes kind by kind."""
    model_class, config_class, extra = ARCHS[arch]
    rank, config, _ = FORMS[form]
    # a layer for each of the form's chunks at least
    layers = max(SMALL["num_hidden_layers"], config.pp * config.virtual)
    architecture = Architecture(name=arch, model_class=model_class, config_class=config_class,
                                kind="held out", config={**SMALL, **extra, "num_hidden_layers": layers})
    started = time.monotonic()
    try:
        report = simulated_hf(architecture, config, rank=rank, seq=SEQ, precision=precision)
    except AutoparError as err:
        return {"arch": arch, "form": form, "status": "refused", "reason": str(err).splitlines()[0]}
    off = [(entry["kind"], entry["axis"], entry["sent_bytes"], entry["predicted_sent_bytes"])
           for entry in report.collectives
           if abs(entry["sent_bytes"] - entry["predicted_sent_bytes"])
           > BYTES_TOLERANCE * max(entry["predicted_sent_bytes"], 1)]
    exact = all(entry["sent_bytes"] == entry["predicted_sent_bytes"] for entry in report.collectives)
    low, high = MEMORY_BAND
    held = low <= report.memory_error <= high
    return {"arch": arch, "form": form, "rank": rank, "status": "pass" if held and not off else "FAIL",
            "simulated_bytes": report.peak_memory_bytes, "predicted_bytes": report.predicted_memory_bytes,
            "memory_error": report.memory_error, "bytes_exact": exact, "bytes_off": off,
            "seconds": time.monotonic() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=",".join(ARCHS), help=f"comma-separated, of {', '.join(ARCHS)}")
    parser.add_argument("--form", action="append", help=f"a form (repeat for several), of: {'; '.join(FORMS)}")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                        help="the plans' precision (default the CPU's, fp32)")
    parser.add_argument("--json", action="store_true", help="print the cases as JSON")
    args = parser.parse_args(argv)
    archs = [name.strip() for name in args.arch.split(",") if name.strip()]
    forms = args.form or list(FORMS)
    unknown = [a for a in archs if a not in ARCHS] + [f for f in forms if f not in FORMS]
    if unknown:
        print(f"unknown architectures or forms: {unknown}", file=sys.stderr)
        return 2
    cases = [(arch, form) for arch in archs for form in forms if FORMS[form][2] <= (arch in MOE)]
    results = []
    for number, (arch, form) in enumerate(cases, 1):
        results.append(run(arch, form, args.precision))
        print(f"[{number}/{len(cases)}] {_line(results[-1])}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        _print(results)
    return int(any(result["status"] == "FAIL" for result in results))


def _line(result: dict) -> str:
    if result["status"] == "refused":
        return f"{result['arch']:<11} {result['form']:<34} refused: {result['reason']}"
    bytes_note = "exact" if result["bytes_exact"] else ("within 5%" if not result["bytes_off"]
                                                         else f"off: {result['bytes_off']}")
    return (f"{result['arch']:<11} {result['form']:<34} {result['simulated_bytes'] / 2**20:8.2f} MiB "
            f"simulated, {result['predicted_bytes'] / 2**20:8.2f} predicted, {100 * result['memory_error']:+5.1f}%; "
            f"bytes {bytes_note}  {result['status']}")


def _print(results: list[dict]) -> None:
    print("architecture form                               simulated    predicted  memory; bytes")
    for result in results:
        print(_line(result))
    errors = [r["memory_error"] for r in results if r["status"] != "refused"]
    if errors:
        print(f"{len(results)} cases, {sum(r['status'] == 'pass' for r in results)} pass; memory "
              f"{100 * min(errors):+.1f}%..{100 * max(errors):+.1f}% (+: held more than predicted); "
              f"bytes exact in {sum(r.get('bytes_exact', False) for r in results)}")


if __name__ == "__main__":
    sys.exit(main())
