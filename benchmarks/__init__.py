"""Side-by-side measurements that write JSON and plots to ``benchmarks/results/``.

One package: run each script from the repository root as ``python -m benchmarks.<script>``; the
scripts share helpers by package imports (``benchmarks.agent_traces``, ``benchmarks.bench_core``,
``benchmarks.grammar_tasks``).
"""
