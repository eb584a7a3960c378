"""The GPU harness of dmi-sglang: qualification cells and benchmarks, one package.

``python -m harness qualify RESULTS`` runs the qualification cells, ``python -m harness
serving`` the serving benchmark, ``python -m harness serve-load`` the HTTP server under
SGLang's own load client, ``python -m harness hooks`` / ``transport`` / ``store`` the
component benchmarks, ``python -m harness profile`` a profiler summary of serving steps (a
diagnostic) and ``python -m harness docs`` regenerates the result tables of ``docs/``.
Engines run in child processes (:mod:`harness.engine`), stock and monitored side by side,
so every comparison is bracketed in one run; every result is one JSON object of one schema
(:mod:`harness.results`) that states the hardware bound beside the figure
(:mod:`harness.bounds`). Only dmi-sglang's public API is used, except by serve-load's
dry-run fake server, which writes its store through the ClickHouse sink directly.
"""
