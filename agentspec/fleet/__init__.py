"""A session-affine fleet: N ``agentspec serve`` workers behind vllm-router on loopback.

process.py  a server in a child process on loopback (``ServerProcess``): started, waited for, stopped
router.py   vllm-router's command line (policy, retries, breaker, health checks), its routing log
workers.py  a worker pinned to its share of the CPUs; ``Fleet``, the workers and the router together
vllm.py     a vLLM worker (its own environment, .venv-vllm: ``make vllm``) as a drop-in worker

``agentspec fleet`` on the command line runs one until interrupted. The router is the ``vllm-router``
package (the ``dev`` extra, docs/install.md).
"""

from agentspec.fleet.router import router_command
from agentspec.fleet.workers import Fleet

__all__ = ["Fleet", "router_command"]
