"""examples/elastic_gpt.py for a test of torchrun's elastic worlds (tests/test_elastic.py): in a
world of more than one node, the ranks of node 1 (torchrun's GROUP_RANK) log the step they
reach to `--hold-log` and wait there after step `--hold-at-step`, so that the test can kill that
node at a known step. Every other argument is the example's."""

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from autopar.runtime.compiled_model import CompiledModel

EXAMPLE = Path(__file__).parents[1] / "examples" / "elastic_gpt.py"


def hold_node_1(step: int, log: Path) -> None:
    taken = CompiledModel.step

    def step_then_hold(self, *args, **kwargs):
        loss = taken(self, *args, **kwargs)
        lost_node = os.environ["GROUP_RANK"] == "1" and int(os.environ["GROUP_WORLD_SIZE"]) > 1
        if lost_node and self.steps == step:
            with log.open("a") as file:
                file.write(f"{dist.get_rank()} {self.steps} {os.getpid()}\n")
            time.sleep(300)     # the node is killed from outside here
        return loss
    CompiledModel.step = step_then_hold


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold-at-step", type=int, required=True)
    parser.add_argument("--hold-log", required=True)
    args, rest = parser.parse_known_args()
    hold_node_1(args.hold_at_step, Path(args.hold_log))
    spec = importlib.util.spec_from_file_location("elastic_gpt", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(rest)
    dist.destroy_process_group()
