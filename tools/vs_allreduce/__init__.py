"""The parts of tools/bench_vs_allreduce.py: ``runs`` (the methods and how each runs), ``figures``
(what their metrics files measured) and ``report`` (the table and the plots)."""
