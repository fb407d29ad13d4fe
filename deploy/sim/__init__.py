"""``iterserve simulate``: the real scheduler, admission and router in virtual time.

The simulator's one home, ``iterserve calibrate`` included: the fleet (:mod:`.fleet`), its
replicas' runner without a model (:mod:`.runner`), the roofline cost model and its hardware
table (:mod:`.roofline`, :mod:`.hardware`; the calibrated model, which live replicas use
too, is :mod:`engine.core.step_cost`), calibration (:mod:`.calibrate`), step-log replay
(:mod:`.replay`), the digital twin (:mod:`.twin`), traces, search, reports and the command
line (:mod:`.cli`).

Kept light: the command line imports this package to build its parser.
"""

ROUTING = ("load-aware", "queue-length")
"""``load-aware``: the router's own choice (:class:`router.choice.ReplicaChooser`);
``queue-length``: Ray Serve's default, two random replicas, the one with fewer requests."""
