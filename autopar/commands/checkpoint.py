"""`autopar checkpoint export DIR --out model.safetensors`: a checkpoint written by
CompiledModel.save, under any plan and on any number of ranks, as one plain state dict under the
model's own names: one safetensors file, or a HuggingFace-style directory of shards with an index."""

from __future__ import annotations

import re

from autopar.errors import AutoparError
from autopar.runtime.checkpoint import export

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def add_arguments(parser):
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub = actions.add_parser("export", help="write a checkpoint's model as safetensors")
    sub.add_argument("directory", help="a checkpoint directory written by CompiledModel.save")
    sub.add_argument("--out", required=True,
                     help="a file ending in .safetensors, or a new directory for HuggingFace-style shards")
    sub.add_argument("--max-shard-size", default="5GB",
                     help="largest shard of a directory output, e.g. 5GB, 500MB (default 5GB)")


def run(args) -> int:
    files = export(args.directory, args.out, max_shard_bytes=parse_size(args.max_shard_size))
    print(f"wrote {len(files)} file{'s' if len(files) > 1 else ''}: {', '.join(str(f) for f in files)}")
    return 0


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise AutoparError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB or 500MB")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").upper()])
