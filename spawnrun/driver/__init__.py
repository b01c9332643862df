"""The parent's driver: the event loop over real children, the dispatcher's actions
performed, a test's life as a state machine (``_jobs``), a child's life after its test
(``_ending``), the replay of its reports through pytest's hooks and the run summary; the
session around them (``_session``, ``_collection``, ``_terminal``).
Runs in the parent; the decisions are the dispatcher's (``spawnrun.dispatch``).
"""
