"""What a process knows of itself and the plumbing every process shares: device runtimes
up, threads, the process table, compiled bytecode, the parent's ``__main__``, coverage,
which modules are third-party libraries. Both sides; the standard library only.
"""
