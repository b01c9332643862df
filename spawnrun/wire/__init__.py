"""The wire between parent and child: one frozen dataclass per message (``_protocol``),
and the reports the parent makes where a child's did not come (``_reports``). Both sides.
"""
