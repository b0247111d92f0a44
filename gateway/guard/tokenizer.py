"""The guard's local tokenizer: the served model's own tokenizer and chat template, in the gateway.

Asking a prefill node's ``/tokenize`` costs every guarded turn an HTTP round trip before its prefill. A
:class:`LocalTokenizer` renders the same ``/tokenize`` request the gateway would send (``body.tokenize_body``)
the way vLLM does (``chat_render``) and encodes it with the model's HF tokenizer, loaded from the directory or
name the configuration gives (``GatewayConfig.tokenizer``). Whether its ids equal the engine's is checked,
not assumed (``tokencheck.py``).

An agent resends its whole history every turn. The rendered text is cut at the tokenizer's added tokens
(``<|im_start|>``, ``<|im_end|>`` ...), which the tokenizer itself splits out before anything else, so each
piece between them encodes the same alone as in the whole text; pieces are cached, and a turn encodes only
what it adds. That holds only for tokenizers whose added tokens match the raw text exactly and whose
pre-tokenizer does not treat the text's start specially; for others, and whenever a self-check at load
disagrees, the whole text is encoded each time. Large encodes run in a worker thread (``encode_batch`` lets
go of the GIL), so a long cold prompt does not stall every stream the event loop relays.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
from kvtether.gateway.guard import chat_render as R

log = logging.getLogger(__name__)

# Uncached text (characters) above which encoding moves to a worker thread: about a millisecond of encoding.
THREAD_CHARS = 4096
# The piece cache's bound, in tokens (a list of ids costs ~40 bytes a token: ~80 MB).
CACHE_TOKENS = 2_000_000
# Texts the load-time self-check encodes both ways (pieces vs whole).
_SELF_CHECK = ("Hello, world!\n\n  indented\tcode = 1 + 2\r\n", " leading space", "ünïcödé ✓ 中文", "\n\n\n", "a")


class LocalTokenizer:
    """Renders and encodes ``/tokenize`` request bodies (chat or completions) as vLLM does."""

    def __init__(self, hf_tokenizer: Any, name: str = "") -> None:
        self.name = name or str(getattr(hf_tokenizer, "name_or_path", ""))
        self.hf = hf_tokenizer
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_tokens = 0
        self._formats: dict[str, tuple[str, frozenset[str]]] = {}
        self._base_params = _apply_params(hf_tokenizer)
        self._split: re.Pattern[str] | None = None
        self._added: dict[str, int] = {}
        self._wrap: tuple[list[int], list[int]] | None = None
        self._setup_pieces()

    @classmethod
    def load(cls, name_or_path: str) -> LocalTokenizer:
        """From a model directory or hub name (slow: imports transformers; run it off the event loop)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path), name_or_path)

    # ---- rendering --------------------------------------------------------------------------------

    def render(self, payload: Mapping[str, Any]) -> tuple[str, bool]:
        """The text vLLM tokenizes for a /tokenize body, and whether it adds special tokens to it."""
        if "messages" not in payload:
            prompt = payload.get("prompt")
            if not isinstance(prompt, str):
                raise R.Unsupported("a completions prompt that is not one string")
            return prompt, bool(payload.get("add_special_tokens", True))
        tools = R.tools_for_template(payload.get("tools"))
        kwargs = R.template_kwargs(payload, tools)
        tools = kwargs.pop("tools", None)
        template = self.hf.get_chat_template(None, tools=tools)
        fmt, variables = self._template_info(template)
        messages = R.developer_as_system(R.conversation(payload.get("messages"), fmt), template)
        text = self.hf.apply_chat_template(conversation=messages, tools=tools, chat_template=template, tokenize=False,
                                           **R.accepted(kwargs, variables, self._base_params))
        if not isinstance(text, str):
            raise R.Unsupported("the chat template did not render text")
        return text, bool(payload.get("add_special_tokens", False))

    def _template_info(self, template: str) -> tuple[str, frozenset[str]]:
        info = self._formats.get(template)
        if info is None:
            env = _template_env()
            info = (R.content_format(env, template), R.template_variables(env, template))
            self._formats[template] = info
        return info

    # ---- encoding ---------------------------------------------------------------------------------

    async def encode(self, payload: Mapping[str, Any]) -> list[int]:
        """The prompt's token ids; raises ``chat_render.Unsupported`` (or the template's own error) when it
        cannot say."""
        text, special = self.render(payload)
        pieces, missing = self._pieces(text, special)
        if pieces is None:
            return await self._whole(text, special)
        if sum(len(p) for p in missing) > THREAD_CHARS:
            await anyio.to_thread.run_sync(self._fill, missing)
        else:
            self._fill(missing)
        return self._assemble(pieces, special)

    def encode_sync(self, payload: Mapping[str, Any]) -> list[int]:
        text, special = self.render(payload)
        pieces, missing = self._pieces(text, special)
        if pieces is None:
            return self._encode_whole(text, special)
        self._fill(missing)
        return self._assemble(pieces, special)

    async def _whole(self, text: str, special: bool) -> list[int]:
        if len(text) > THREAD_CHARS:
            return await anyio.to_thread.run_sync(self._encode_whole, text, special)
        return self._encode_whole(text, special)

    def _encode_whole(self, text: str, special: bool) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode_batch([text], add_special_tokens=special)[0].ids)
        return list(self.hf(text, add_special_tokens=special)["input_ids"])

    def _pieces(self, text: str, special: bool) -> tuple[list[str] | None, list[str]]:
        """The text cut at added tokens (odd positions), and the pieces not in the cache; (None, []) when the
        whole text must be encoded."""
        if self._split is None or (special and self._wrap is None):
            return None, []
        pieces = self._split.split(text)
        cache = self._cache
        missing = list(dict.fromkeys(p for p in pieces[::2] if p and p not in cache))
        return pieces, missing

    def _fill(self, missing: list[str]) -> None:
        if not missing:
            return
        assert self._backend is not None
        encoded = self._backend.encode_batch(missing, add_special_tokens=False)
        with self._lock:
            for piece, enc in zip(missing, encoded, strict=True):
                ids = list(enc.ids)
                self._cache[piece] = ids
                self._cached_tokens += len(ids)
            while self._cached_tokens > CACHE_TOKENS and len(self._cache) > len(missing):
                _, dropped = self._cache.popitem(last=False)
                self._cached_tokens -= len(dropped)

    def _assemble(self, pieces: list[str], special: bool) -> list[int]:
        out: list[int] = []
        cache, added = self._cache, self._added
        with self._lock:
            for i, piece in enumerate(pieces):
                if i % 2:
                    out.append(added[piece])
                elif piece:
                    ids = cache.get(piece)
                    if ids is None:  # evicted by a concurrent fill: encode it again
                        assert self._backend is not None
                        ids = list(self._backend.encode_batch([piece], add_special_tokens=False)[0].ids)
                    else:
                        cache.move_to_end(piece)
                    out.extend(ids)
        if special and self._wrap is not None:
            head, tail = self._wrap
            out = [*head, *out, *tail]
        return out

    # ---- when pieces are exact --------------------------------------------------------------------

    def _setup_pieces(self) -> None:
        """Turn piece caching on only where it provably equals encoding the whole text, then self-check."""
        backend = self._backend
        if backend is None or getattr(backend, "encode_special_tokens", False):
            return
        spec = json.loads(backend.to_str())
        added = spec.get("added_tokens") or []
        if not added or any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") or
                            (t.get("normalized") and spec.get("normalizer")) for t in added):
            return
        if '"prepend_scheme": "first"' in json.dumps(spec.get("pre_tokenizer")):
            return  # Metaspace marks only the text's first piece: pieces are not independent
        self._added = {t["content"]: int(t["id"]) for t in added}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
                                 + ")")
        self._wrap = self._special_wrap()
        tokens = list(self._added)
        samples = [*_SELF_CHECK, tokens[0].join(_SELF_CHECK), "".join(f"x{t} y" for t in tokens)]
        for special in (False, True):
            for text in samples:
                pieces, missing = self._pieces(text, special)
                if pieces is None:
                    continue
                self._fill(missing)
                if self._assemble(pieces, special) != self._encode_whole(text, special):
                    log.warning("tokenizer %s: cached pieces differ from whole-text encoding; caching off", self.name)
                    self._split, self._cache, self._cached_tokens = None, OrderedDict(), 0
                    return

    def _special_wrap(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor puts around a text when special tokens are added (BOS/EOS)."""
        with_special = self._encode_whole("x", True)
        plain = self._encode_whole("x", False)
        for start in range(len(with_special) - len(plain) + 1):
            if with_special[start:start + len(plain)] == plain:
                return with_special[:start], with_special[start + len(plain):]
        return None


def _template_env() -> Any:
    """A Jinja environment that parses chat templates as transformers does (its extensions and tags)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template("").environment
    except Exception:  # a transformers without that helper: a plain environment with its loop controls
        import jinja2.ext
        import jinja2.sandbox

        return jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])


def _apply_params(hf_tokenizer: Any) -> frozenset[str]:
    """The named parameters of ``apply_chat_template`` (the tokenizer's own and the base class's): vLLM passes
    template arguments with these names on even when the template does not read them."""
    names: set[str] = set()
    fns: Sequence[Any] = [type(hf_tokenizer).apply_chat_template]
    try:
        from transformers import PythonBackend

        fns = [*fns, PythonBackend.apply_chat_template]
    except ImportError:
        pass
    for fn in fns:
        for p in inspect.signature(fn).parameters.values():
            if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
                names.add(p.name)
    return frozenset(names)
