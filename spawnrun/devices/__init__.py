"""Devices: the inventory and its vendors, the ledger of claims, NVML, and the packing
policy (which tests may share a device). Runs in the parent, never touching CUDA.
"""
