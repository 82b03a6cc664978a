"""Deterministic virtual-time replay: the router's real policies against simulated
engines' block pools, in one process, without HTTP or a wall clock.

``bench`` talks to the router and the replicas over HTTP only, so that what it measures
is what a deployment sees.  This package is the other instrument: it imports the
policy code itself (``router``), the simulated engine's scheduler and block pool
(``replica``) and the index with its event ingestion (``index``), and drives them from
one discrete-event loop in simulated seconds.  Every figure (cached tokens, simulated
TTFT, moves) is then a function of the trace and the configuration alone: the machine's
load cannot leak in, and a policy change can be evaluated in seconds.  Nothing imports
this package but the ``kvroute`` command line (an import-linter contract).

Modules (under ``kvroute.replay``): ``requests`` (what is replayed), ``replica`` (one
simulated replica and its event stream into the index), ``loop`` (the event loop and the
policies), ``summary`` (figures and tables), ``cli`` (``kvroute replay``).
"""
