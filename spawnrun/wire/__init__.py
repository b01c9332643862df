"""The wire between parent and child: one frozen dataclass per message (``_orders``,
``_replies``, ``_forking``), a test's identity across it (``_identity``), how messages
travel (``_protocol``), and the reports the parent makes where a child's did not come
(``_reports``). Both sides.
"""
