"""Production telemetry: what serving engines report about speculative decoding, read by ``dflash-doctor watch``.

The doctor's own replays answer "is this pair set up right"; this package answers "is it still working in
production". It reads the numbers engines already publish - Prometheus counters on ``/metrics``, a
Prometheus server's HTTP API, periodic log lines, and the per-request metrics in captured responses -
turns them into windows of the same metrics every other view uses (``num_drafts``, ``num_draft_tokens``,
``num_accepted_tokens``, ``num_accepted_tokens_per_pos``, ``mean_acceptance_length`` with the bonus
token, vLLM's definition), compares each window with a baseline, and says when to fall back.

Layout: :mod:`.counts` (the window arithmetic and its interval), :mod:`.exposition` (Prometheus text
format), :mod:`.server_metrics` (one reader per engine's metric names), :mod:`.logs` and :mod:`.captured_responses`
(one parser per engine's log line / response payload), :mod:`.sources` (where numbers come from),
:mod:`.watcher` (windows over time, counter resets, scrape failures), :mod:`.verdict` (alerts and the
fallback advice), :mod:`.watch_record` (the run directory), :mod:`.exporter` (optional Prometheus gauges).
"""
