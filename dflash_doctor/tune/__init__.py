"""`dflash-doctor tune`: the step-up experiment on the user's own engine.

For each K of a grid (0 = speculation off) the server is launched (or given), the workload is streamed to
it at each load level, and latency, throughput, acceptance and rollback compute are measured per request
(:mod:`.measure`, :mod:`.servers`; the load levels are :mod:`.loads`). :mod:`.analysis` turns the requests into
per-class figures with bootstrap intervals and the net speedup against K = 0; :mod:`.prediction` fits the engine's step
costs from some K points and predicts the others from the doctor's teacher-forced sweep; :mod:`.advice` writes
the recommendation as the engine's own setting; :mod:`.experiment` runs it all into a run directory and
:mod:`.views` renders it.
"""
