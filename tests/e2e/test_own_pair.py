"""Measuring your own pair: ``agentspec bench`` and the demo agent's A/B take ``--model``,
``--draft-model``, ``--drafter``, ``--dtype`` and ``--device``, and refuse bad ones in one line.

The pair is a random 2-layer Qwen3 target and a 1-layer Qwen3 draft behind the embedded tokenizer,
saved as folders with ``save_pretrained``, as a user's own models would be: the bench runs as a
user runs it, in a subprocess of the command line, and the demo in this process. Their answers are
noise (the demo's check marks them wrong, which with ``--model`` is reported, not failed on); what
is checked is that both run, write their JSON and record what they ran on, and that speculative
replies equal plain ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from agentspec import cli
from agentspec.models import ensure_default_model
from examples import agent_demo as demo


def save_qwen3(build, tokenizer, folder, seed: int, layers: int) -> str:
    """A random Qwen3 of the tokenizer's vocabulary, saved with it into ``folder``; its LM head
    sharpened so that greedy argmaxes are clear (no near-ties for the paths' roundings to break)."""
    model = build("qwen3", seed, len(tokenizer), layers=layers)
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    model.config.max_position_embeddings = 4096  # the agent prompts' length; RoPE does not depend on it
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def own_pair(tmp_path_factory, tiny_qwen) -> SimpleNamespace:
    """Folders of a target, a draft of its tokenizer and a draft of another tokenizer (one more token)."""
    root = tmp_path_factory.mktemp("own_pair")
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    other = AutoTokenizer.from_pretrained(ensure_default_model())
    other.add_special_tokens({"additional_special_tokens": ["<|not_the_targets|>"]})
    return SimpleNamespace(
        target=save_qwen3(tiny_qwen, tokenizer, root / "target", seed=0, layers=2),
        draft=save_qwen3(tiny_qwen, tokenizer, root / "draft", seed=1, layers=1),
        other_draft=save_qwen3(tiny_qwen, other, root / "other_draft", seed=1, layers=1),
    )


def test_bench_measures_a_pair_of_folders_and_records_it(own_pair, tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "agentspec.cli", "bench", "--model", own_pair.target, "--draft-model",
               own_pair.draft, "--drafter", "auto", "--dtype", "float32", "--device", "cpu",
               "--max-new-tokens", "8", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    settings, environment = result["settings"], result["environment"]
    assert (settings["model"], settings["draft_model"], settings["drafter"]) == (
        own_pair.target, own_pair.draft, "auto"
    )  # fmt: skip
    assert (environment["model"], environment["draft_model"]) == (own_pair.target, own_pair.draft)
    assert (environment["device"], environment["dtype"]) == ("cpu", "torch.float32")
    assert result["single_systems"] == [
        "transformers generate", "transformers assisted", "transformers prompt lookup",
        "agentspec none", "agentspec auto",
    ]  # fmt: skip
    assert all(result["single"]["identical_to_generate"].values()), result["single"]["identical_to_generate"]
    assert f"{own_pair.target} (draft {own_pair.draft})" in out.with_suffix(".md").read_text()


def test_the_demo_runs_its_a_b_on_a_pair_of_folders(own_pair, tmp_path, capsys, one_thread):
    out = tmp_path / "demo.json"
    pair = ["--model", own_pair.target, "--draft-model", own_pair.draft, "--tasks", "2"]
    assert demo.main([*pair, "--max-tokens", "16", "--drafter", "suffix", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["model"], figures["draft_model"]) == (own_pair.target, own_pair.draft)
    assert (figures["drafter"], figures["device"], figures["dtype"]) == ("suffix", "cpu", "torch.float32")
    assert figures["same_replies"] is True and figures["answers_checked"] is False
    assert len(figures["calls"]) >= 2 and figures["speedup"] > 0
    printed = capsys.readouterr().out
    assert "ChatSpecDecode(drafter='suffix') (speculative, prefix cache):" in printed
    assert f"{figures['right']}/2 answers right" in printed
    # a random model's answers are wrong: checked, that is exit status 1
    assert demo.main([*pair, "--tasks", "1", "--max-tokens", "4", "--check-answers"]) == 1


@pytest.mark.parametrize(
    "options, message",
    [
        (["--model", "/no/such/folder"], "--model /no/such/folder: no such folder or file"),
        (["--draft-model", "./no_such_draft"], "--draft-model ./no_such_draft: no such folder or file"),
        (["--device", "tpu9"], "--device tpu9: "),
    ],
    ids=["model", "draft", "device"],
)
def test_bench_refuses_a_pair_that_is_not_there(options, message, tmp_path, capsys):
    assert cli.main(["bench", *options, "--out", str(tmp_path / "bench")]) == 2
    assert f"agentspec bench: {message}" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_bench_refuses_a_draft_of_another_tokenizer(own_pair, tmp_path, capsys, one_thread):
    options = ["--model", own_pair.target, "--draft-model", own_pair.other_draft]
    assert cli.main(["bench", *options, "--out", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err
    assert f"--draft-model {own_pair.other_draft}: its tokenizer is not the target's" in err
    assert "vocabulary sizes differ" in err


def test_bench_refuses_a_drafter_the_pair_cannot_build(own_pair, tmp_path, capsys, one_thread):
    options = ["--model", own_pair.target, "--no-draft-model", "--drafter", "model"]
    assert cli.main(["bench", *options, "--out", str(tmp_path / "bench")]) == 2
    assert (
        "--drafter model: drafter='model' needs a pair loaded with a draft_model" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "options, invalid",
    [
        (["--drafter", "fastest"], "--drafter: invalid choice: 'fastest'"),
        (["--dtype", "float16"], "--dtype: invalid choice"),
    ],
    ids=["drafter", "dtype"],
)
def test_an_unknown_drafter_or_dtype_is_refused_with_the_choices(options, invalid, capsys):
    for main, argv in ((cli.main, ["bench", *options]), (demo.main, options)):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert invalid in capsys.readouterr().err


def test_the_demo_refuses_a_model_that_is_not_there(capsys):
    assert demo.main(["--model", "/no/such/folder"]) == 2
    assert "agent_demo: --model /no/such/folder: no such folder or file" in capsys.readouterr().err


def test_a_conversation_that_breaks_off_is_kept_as_far_as_it_went():
    """A weak model's reply the agent cannot use ends its conversation, not the A/B."""

    class Broken:
        def invoke(self, inputs, config):
            raise ValueError("the answer is no JSON")

        def get_state(self, config):
            return SimpleNamespace(values={"messages": ["the question"]})

    state = demo.converse(Broken(), "Q?", {}, keep_going=True)
    assert state == {"messages": ["the question"], "error": "ValueError: the answer is no JSON"}
    assert demo.check(407, state) == (
        False,
        "WRONG: the conversation stopped on ValueError: the answer is no JSON",
    )
    with pytest.raises(ValueError):
        demo.converse(Broken(), "Q?", {}, keep_going=False)
