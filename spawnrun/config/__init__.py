"""Configuration: the settings table resolved once per run, its validators, each test's
plan (made once at collection, kept in ``item.stash``) and ``--spawn-explain``. Runs in
the parent.
"""
