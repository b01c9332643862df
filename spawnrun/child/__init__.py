"""A test's process: a spawned child, a fork of a template, or a template itself (a child
that collected its file and forks one process per test). Runs in children only; never
imports the parent's driver, launcher, configuration or learned state (a test checks).
Its own side of budgets, the stacks of its processes, how it leaves, and the rules a
process that forks follows (seeded streams, threads, the environment its imports read).
"""
