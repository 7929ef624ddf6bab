"""``support-replay ray-run``: the engines, the router and the trainer ranks placed and restarted by Ray.

The same fleet as ``local-run`` (our ``serve`` per engine, our router, FSDP2 trainer ranks), each a Ray actor in
one placement group laid out as slime and Miles lay theirs out (placement.py); Ray owns where each runs and when
it is restarted (actors.py, supervisor.py); run.py is the driver. docs/scaling.md, "On Ray".
"""
