"""Measuring on the user's own serving engine (`check --engine URL`).

client.py talks to an OpenAI-compatible server; responses.py and prometheus.py read each engine's
speculative figures in vLLM's definitions; server_run.py turns a workload into a run directory from
those figures; agreement.py replays the same turns in the embedded engine for the engine-agreement
check; the command's sequence is :func:`dflash_doctor.pipeline.run_server_check`.
"""
