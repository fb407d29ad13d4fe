"""``iterserve simulate``: the real scheduler, admission and router in virtual time.

Kept light: the command line imports this package to build its parser.
"""

ROUTING = ("load-aware", "queue-length")
"""``load-aware``: the router's own choice (:class:`router.choice.ReplicaChooser`);
``queue-length``: Ray Serve's default, two random replicas, the one with fewer requests."""
