"""Conformance: HuggingFace architectures x parallel forms, each compared with one process.

    python benchmarks/conformance.py [--arch llama,t5] [--form "dp2 x tp2"] [--timeout 600]
                                     [--out docs/conformance.md]

Every case (autopar.testing.conformance) trains a tiny model of one architecture
(autopar.models.hf_zoo: 4 layers, hidden 64, 4 heads, vocab 128, seq 16, global batch 8, fp32,
eval mode) for 3 AdamW steps on real gloo ranks and compares losses and final parameters with one
process. A case passes, fails (with the error's first line or the first difference) or is
refused (autopar raised an AutoparError at plan or compile time, saying why). Prints progress per
case, then the table, and writes the table to --out (docs/conformance.md by default) unless
filters are given and --out is not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch._dynamo  # noqa: F401  (imported once here, before the ranks fork)

from autopar.models.hf_zoo import ARCHITECTURES, resolve
from autopar.testing.conformance import FORMS, CaseResult, run_case

MARK = {"pass": "pass", "fail": "FAIL", "refused": "refused"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=",".join(ARCHITECTURES),
                        help=f"comma-separated, of {', '.join(ARCHITECTURES)}")
    parser.add_argument("--form", action="append",
                        help=f"a form (repeat for several), of: {'; '.join(FORMS)}")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    parser.add_argument("--out", type=Path, default=None,
                        help="markdown file for the table (default docs/conformance.md on a full run)")
    args = parser.parse_args(argv)
    archs = [name.strip() for name in args.arch.split(",") if name.strip()]
    forms = args.form or list(FORMS)
    unknown = [name for name in forms if name not in FORMS]
    if unknown:
        parser.error(f"unknown form(s) {unknown}; known: {list(FORMS)}")
    resolve(archs)      # every model class imported once, before any rank forks

    results = []
    # expert-parallel forms apply to mixtures of experts only ("-" in the table elsewhere)
    cases = [(arch, form) for arch in archs for form in forms
             if ARCHITECTURES[arch].moe or not FORMS[form].experts]
    for arch, form in cases:
        result = run_case(arch, form, timeout=args.timeout)
        results.append(result)
        print(f"[{len(results)}/{len(cases)}] {arch:10} {form:26} {result.status:8} "
              f"{result.seconds:6.1f} s  {result.detail[:150]}", flush=True)
    table = render(results, archs, forms)
    print(table)
    out = args.out or (Path(__file__).resolve().parents[1] / "docs" / "conformance.md"
                       if args.arch == parser.get_default("arch") and args.form is None else None)
    if out is not None:
        out.write_text(table)
        print(f"written to {out}")
    return 0 if all(r.status != "fail" for r in results) else 1


def render(results: list[CaseResult], archs: list[str], forms: list[str]) -> str:
    """A markdown page: the matrix of outcomes, then the reason of each failure and refusal."""
    by_case = {(r.arch, r.form): r for r in results}
    counts = {status: sum(r.status == status for r in results) for status in MARK}
    lines = ["# Conformance: HuggingFace architectures x parallel forms", "",
             ("Written by `python benchmarks/conformance.py`. Each case trains a tiny model (4 layers, "
              "hidden 64, 4 heads, vocab 128, seq 16, global batch 8, fp32, eval mode) for 3 AdamW steps "
              "on gloo ranks and compares the loss at every step and the final parameters with one "
              "process (rtol 1e-5). *refused*: autopar declined at plan or compile time and said why."), "",
             (f"{counts['pass']} pass, {counts['fail']} fail, {counts['refused']} refused, "
              f"of {len(results)} cases."), "",
             "| architecture | kind | " + " | ".join(forms) + " |",
             "|---|---|" + "---|" * len(forms)]
    notes = []
    for arch in archs:
        cells = []
        for form in forms:
            result = by_case.get((arch, form))
            if result is None:
                cells.append("-" if FORMS[form].experts and not ARCHITECTURES[arch].moe else "")
                continue
            cell = MARK[result.status]
            if result.status != "pass":
                notes.append(f"{len(notes) + 1}. **{arch}, {form}** ({result.status}): {result.detail}")
                cell += f" [{len(notes)}]"
            cells.append(cell)
        lines.append(f"| {arch} | {ARCHITECTURES[arch].kind} | " + " | ".join(cells) + " |")
    forms_text = [f"- **{name}**: {describe_form(name)}" for name in forms]
    return "\n".join(lines + ["", "Forms:", *forms_text, "", "Reasons:" if notes else "", *notes]) + "\n"


def describe_form(name: str) -> str:
    form = FORMS[name]
    if form.config is None:
        limit = (", under the largest memory limit that makes it pipeline" if form.pipeline_by_memory
                 else ", under the largest memory limit that makes it split experts (MoE only)"
                 if form.experts_by_memory else "")
        return f"the planner's own plan on {form.mesh}{limit}"
    changed = {key: value for key, value in form.config.to_dict().items()
               if value != getattr(type(form.config)(), key, None)}
    moe = " (MoE only)" if form.experts else ""
    return f"Config({', '.join(f'{k}={v!r}' for k, v in changed.items())}) on {form.mesh}{moe}"


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    sys.exit(code)
