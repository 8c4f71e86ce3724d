"""The runtime: runs a plan's rewritten stages on torch.distributed.

    build.py           build_runtime: a plan to this rank's CompiledModel, step by step
    compiled_model.py  CompiledModel: step, state, checkpoints (checkpoint.py)
    rank_grid.py       the rank grid (pp, dp, tp) and the process groups over it
    data_parallel.py   FSDP2 for data parallelism and ZeRO, one group per layer (gloo_reduce.py:
                       its reduce-scatter on CPU meshes without gloo's hidden copy)
    schedule.py        the micro-batch loop and torch.distributed.pipelining's schedules
    precision.py       autocast, FSDP2's mixed-precision policy, fp16's loss scaler
    gradients.py, tied.py  gradients reduced after the backward (tensor-parallel partial sums,
                       weights tied across stages)
    materialize.py     a meta model's shards given storage and values, this rank's only
    checks.py          the user's loss, optimizer, buffers and inputs, checked
    launch.py          starting ranks (autopar.launch) and joining torchrun's process group

The graph rewrites it applies are autopar.passes'.
"""
