"""``chunkattn bench``: a load tester that plays a model runner against a chunkattn server.

- ``workload``: what each simulated sequence sends (lengths, traces, prefill pieces, layers).
- ``config``: BenchConfig, the run's options; ``runner``: drives the server (closed or open loop, unary or
  stream) and records every call in a ``recorder``; ``verify``: --verify's reference checks;
  ``servermetrics``: the server's /metrics during the run (--metrics-url).
- ``stats``: percentiles and summaries; ``promtext``: the server's Prometheus numbers.
- ``report``: the JSON, CSV and table; ``html`` and ``svg``: the self-contained HTML report.
"""
