"""The workers behind :class:`~guideloom_pipes.pipes.ReadSamples`.

- :mod:`.tasks`: the read task a worker runs (ids -> samples -> batch, a batch failing
  alone); torch-free.
- :mod:`.threads`: the worker-thread pool, and what both pools share.
- :mod:`.processes`: the worker-process pool (parent side).
- :mod:`.process_main`: what runs inside a worker process; torch-free.
- :mod:`.transport`: how a worker process hands large results back through shared memory;
  torch-free.

Nothing is imported here: a worker process imports only the torch-free modules it needs.
"""
