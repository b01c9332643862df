"""A deterministic simulator for the dispatcher (``world``)."""
