"""The suites that measure agentspec beside what users would pick instead; ``python -m benchmarks`` lists
them (``__main__.py``). They share ``harness`` (arguments, the machine, output, servers, calls) and
``workloads`` (agent traces, grammar tasks, questions); no suite imports another.
"""
