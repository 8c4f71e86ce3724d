"""The cost model: devices and meshes, compute, communication, memory, and one estimator."""
