"""What runs learn and later runs read, in pytest's cache: peaks, durations, loads,
what a file's boot touched, tests a fork doubted. Runs in the parent; every record is
checked when read.
"""
