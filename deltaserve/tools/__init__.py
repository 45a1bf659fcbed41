"""Commands built on the layers below: the memory planner (planner.py), the real-vs-simulated gate
(validate/) and N real replicas behind a router (cluster.py)."""
