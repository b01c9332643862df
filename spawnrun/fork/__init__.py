"""The zygote: the template process fast mode forks test children from, and the configured
templates it keeps. Runs in the zygote and its forks (``_declared``, what a suite's files
import, is read in the parent for it).
"""
