"""``spawnrun.call``: run one function in a fresh spawn child and bring back its result
(the caller's side, and the child's).
"""
