"""Devices: the inventory, its vendors and their discovery, NVML, the allocator and the
xdist ledger of claims, and the packing policy (which tests may share a device). Runs in
the parent, never touching CUDA.
"""
