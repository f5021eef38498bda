#!/usr/bin/env bash
# docs/install.md's two install lines, exactly as written there, run against this checkout's last commit
# (its git URL at HEAD: what is committed, not the working tree) in clean virtual environments, then
# checks of what they installed.
#  - The local line, torch preinstalled (the CPU build, as scripts/setup.sh installs it): each of the
#    three distributions came from HEAD by git URL (none from an index), installs its one top-level name
#    (agentspec with the embedded draft, langchain_agentspec, agentspec_toolcalls; nothing named
#    integrations), carries the LICENSE, and pins its siblings only with a local version label that no
#    index can serve; `import agentspec` reaches no LangChain module; `agentspec fetch` runs and
#    ChatSpecDecode() answers one call on the embedded default pair.
#  - The remote-only line, without torch: neither the engine nor torch is installed, and
#    ChatSpecDecode(base_url=...) answers one call from a stand-in OpenAI-compatible endpoint and reads
#    tool calls without importing either.
# CI runs it after the tests (.ci/run), on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
head=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "check_wheels: checking HEAD $head; the working tree's uncommitted changes are not in it" >&2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_QUIET=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The lines as docs/install.md writes them; each must be a line of that file at HEAD.
LOCAL_LINE='pip install "agentspec-toolcalls @ git+$REPO#subdirectory=toolcalls" "agentspec-decode @ git+$REPO" "langchain-agentspec[local] @ git+$REPO#subdirectory=integrations/langchain"'
REMOTE_LINE='pip install "agentspec-toolcalls @ git+$REPO#subdirectory=toolcalls" "langchain-agentspec[remote] @ git+$REPO#subdirectory=integrations/langchain"'
for line in "$LOCAL_LINE" "$REMOTE_LINE"; do
  git show "HEAD:docs/install.md" | grep -qxF -- "$line" || {
    echo "check_wheels: docs/install.md at HEAD lacks the line: $line" >&2
    exit 1
  }
done
# this checkout as a file:// URL (percent-encoded), at its HEAD commit
REPO="$("$PYTHON" -c 'import pathlib, sys; print(pathlib.Path(sys.argv[1]).resolve().as_uri())' "$PWD")@$head"
git show "HEAD:LICENSE" >"$work/LICENSE"

# run_line VENV LINE: LINE with REPO set and `pip` the venv's own, away from the checkout
run_line() {
  (cd "$work" && export REPO PATH="$1/bin:$PATH" && eval "$2")
}

"$PYTHON" -m venv "$work/local"
"$work/local/bin/python" -m pip install --upgrade pip
"$work/local/bin/python" -m pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
run_line "$work/local" "$LOCAL_LINE"
(cd "$work" && "$work/local/bin/agentspec" fetch)

"$PYTHON" -m venv "$work/remote"
"$work/remote/bin/python" -m pip install --upgrade pip
run_line "$work/remote" "$REMOTE_LINE"

cd "$work"  # away from the checkout: only what the lines installed can be imported
"$work/local/bin/python" - "$work/LICENSE" "$head" <<'PY'
import importlib.util
import json
import re
import sys
import time
from importlib.metadata import distribution
from pathlib import Path

licence, head = Path(sys.argv[1]).read_bytes(), sys.argv[2]
TOP = {
    "agentspec-decode": {"agentspec"},
    "agentspec-toolcalls": {"agentspec_toolcalls"},
    "langchain-agentspec": {"langchain_agentspec"},
}
SIBLING = re.compile(r"(agentspec-decode|agentspec-toolcalls|langchain-agentspec)\b")
for name, want in TOP.items():
    dist = distribution(name)
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    assert origin.get("vcs_info", {}).get("commit_id") == head, f"{name} is not HEAD's by git URL: {origin}"
    top = {f.parts[0] for f in dist.files if f.parts[0] != ".." and not f.parts[0].endswith(".dist-info")}
    assert top == want, f"{name} installs {sorted(top)}, expected {sorted(want)}"
    texts = [f.locate().read_bytes() for f in dist.files if f.parts[-2:] == ("licenses", "LICENSE")]
    assert texts == [licence], f"{name} carries {len(texts)} LICENSE file(s), not the repository's"
    assert dist.metadata["License-Expression"] == "Apache-2.0", dist.metadata["License-Expression"]
    # a sibling pinned without a local label (+git) is one PyPI could serve, under a name not ours
    loose = [r for r in dist.requires or [] if SIBLING.match(r) and not re.match(r"[\w-]+==[\w.]+\+\w", r)]
    assert not loose, f"{name} requires {loose}"
    print(f"{name} {dist.version}: from {head[:12]} by git URL, installs {sorted(top)}, with LICENSE")

integration = distribution("langchain-agentspec").requires
assert any(r.startswith("agentspec-toolcalls") and "extra" not in r for r in integration), integration
assert all("extra ==" in r for r in integration if r.startswith("agentspec-decode")), integration

import agentspec  # noqa: E402

leaked = sorted(m for m in sys.modules if m.startswith(("langchain", "integrations")))
assert not leaked, f"import agentspec loaded {leaked}"
assert agentspec.__file__.startswith(sys.prefix), agentspec.__file__
from agentspec.models import default_draft_folder  # noqa: E402

assert default_draft_folder() is not None, "the embedded draft is missing from the wheel"
assert importlib.util.find_spec("integrations") is None, "a module named integrations is installed"

from langchain_agentspec import ChatSpecDecode  # noqa: E402

started = time.perf_counter()
reply = ChatSpecDecode(max_tokens=8).invoke("Say hello.")
assert isinstance(reply.content, str) and reply.content.strip(), reply
seconds = time.perf_counter() - started
print(f"ok: ChatSpecDecode() on the embedded pair answered {reply.content!r} ({seconds:.1f} s with loading)")
PY

# The remote path: its own environment, without torch or the engine.
"$work/remote/bin/python" - <<'PY'
import importlib.util
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

present = [m for m in ("agentspec", "torch", "transformers") if importlib.util.find_spec(m) is not None]
assert not present, f"the remote line installed {present}"
os.environ["NO_PROXY"] = "127.0.0.1"  # the stand-in endpoint is local, whatever proxy is set


class Endpoint(BaseHTTPRequestHandler):
    """A stand-in OpenAI-compatible chat endpoint: every call answers "Hello."."""

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/chat/completions", self.path
        message = {"role": "assistant", "content": "Hello."}
        body = json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": request["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
threading.Thread(target=server.serve_forever, daemon=True).start()

from langchain_agentspec import ChatSpecDecode, parse_tool_calls  # noqa: E402
from langchain_agentspec.text_calls import TextCalls  # noqa: E402

url = f"http://127.0.0.1:{server.server_port}/v1"
reply = ChatSpecDecode(base_url=url, model="stand-in", api_key="none").invoke("Say hello.")
assert reply.content == "Hello.", reply
call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
parsed = parse_tool_calls(call, {"add"})
assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("add", {"a": 1})], parsed
text, found = TextCalls(frozenset({"add"}), single=False).feed(call)
assert text == "" and [c["function"]["name"] for c in found] == ["add"], (text, found)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"agentspec", "torch", "transformers"})
assert not heavy, f"the remote path loaded {heavy}"
server.shutdown()
print("ok: ChatSpecDecode(base_url=...) answered and read tool calls without the engine or torch")
PY
