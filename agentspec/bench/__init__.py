"""``agentspec bench``: agentspec side by side with what users would pick instead (``run.py``).

Workloads (``workloads.py``, ``conversation.py``), the systems measured (``systems.py``), the
roofline (``roofline.py``) and the report (``report.py``: summaries, goals, Markdown, plots).
"""
