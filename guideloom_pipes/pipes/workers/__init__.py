"""The workers behind :class:`~guideloom_pipes.pipes.ReadSamples`.

- :mod:`.schedule`: the scheduling policy (who reads the next batch, chunk sizes, jobs in
  flight), pure; torch-free.
- :mod:`.jobs`: a stage's jobs on its workers, submitted as the schedule says and handed
  back in order.
- :mod:`.tasks`: the read task a worker runs (ids -> samples -> batch, a batch failing
  alone); torch-free.
- :mod:`.threads`: the worker-thread pool, and what both pools share.
- :mod:`.processes`: the worker-process pool (parent side).
- :mod:`.process_main`: what runs inside a worker process; torch-free.
- :mod:`.transport`: how a worker process hands large results back through shared memory;
  torch-free.

Nothing is imported here: a worker process imports only the torch-free modules it needs.
"""
