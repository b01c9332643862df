"""Where a test's child is started: its spec, options and environment, the process's
lifecycle (start, stream, kill its group), and the parent's handle on the zygote
(fast mode), started early. Runs in the parent.
"""
