"""The `autopar` command. Each subcommand lives in autopar/commands/<name>.py and provides
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their subcommand runs,
so `autopar --help` is instant."""

import argparse
import sys
from importlib import import_module

from autopar.errors import AutoparError

SUBCOMMANDS = {
    "inspect": "capture a model and show its graph: parameters, FLOPs, blocks, activations",
    "estimate": "predict step time, throughput and memory of a Megatron-style configuration",
    "calibrate": "measure compute efficiencies on the local device and write a calibration file",
    "plan": "plan a model for a mesh and save the plan as JSON",
    "explain": "show a saved plan: stages, memory and time, and a pipeline timeline picture",
    "diff": "compare two saved plans",
    "simulate": "build and step chosen ranks of a plan on fake tensors: peak memory and collectives",
    "validate": "train forced configurations on gloo ranks and check predicted step times against measured",
    "bench": "solver benchmark: autopar's plans against the best Megatron-style grid configuration",
    "checkpoint": "export a checkpoint written by CompiledModel.save as one safetensors state dict",
    "demo": "plan and train a small GPT on a CPU mesh of gloo processes, checked against one process",
}


def build_parser():
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    module = import_module(f"autopar.commands.{name}")
    sub = argparse.ArgumentParser(prog=f"autopar {name}", description=SUBCOMMANDS[name])
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return module.run(args) or 0
    except AutoparError as err:
        print(f"autopar {name}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
