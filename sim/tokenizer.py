"""A deterministic, download-free tokenizer with a ChatML special-token set.

Good enough to make token counts and token identity behave like a real BPE tokenizer where the gateway
can observe them: about one token per English word, special tokens as single ids, and *canonical*
encoding (``encode(decode(ids)) == ids`` for every sequence ``encode`` or the model produces), so an
assistant reply sent back by the client re-tokenizes to exactly the ids the model generated.

Layout of the id space: special tokens first, then the 256 byte tokens (fallback for anything the
vocabulary lacks), then word pieces. Encoding splits out special tokens, pre-tokenizes with a regex
whose pieces never cross a newline (so text after ``"\\n"`` encodes the same whatever precedes it),
and maps each piece to a vocabulary id, else to the longest vocabulary sub-pieces, else to bytes.

The text between two special tokens (a segment) is encoded through a bounded LRU cache keyed by the
segment text: an agent resends its whole history every turn, so all but the newest messages are cache
hits, and /tokenize plus the chat path cost microseconds per repeated message instead of a pure-Python
pass over the whole prompt on the node's event loop (real vLLM tokenizes in Rust, off the engine loop).
"""

from __future__ import annotations

import codecs
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from functools import lru_cache

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
# GLM-4.5 / 4.7 / 5 write a tool call's arguments as XML-like pairs between these tags (vLLM's glm47 parser),
# and their tokenizer has each tag as one added special token, beside <tool_call> and </tool_call>.
ARG_KEY_START = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE_START = "<arg_value>"
ARG_VALUE_END = "</arg_value>"

SPECIAL_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    THINK_START,
    THINK_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
    ARG_KEY_START,
    ARG_KEY_END,
    ARG_VALUE_START,
    ARG_VALUE_END,
)
_BYTE_BASE = len(SPECIAL_TOKENS)
_WORD_BASE = _BYTE_BASE + 256

# Common English words: the model answers with these, and they make ordinary text ~1 token per word.
_WORD_LIST = """
the of and to in is was that for on are with as it be at by
this had not but from or have an they which one you were all we her she there would their will when who him
been has more if no out do so can what up said about other into than its time only could new them man some
these then two first may any like now my such make over our even most me state after also made many did must
before back see through way where get much go well your know should down work year because come people just
say each those take day good how long own too little use us very great still men here life both between old
under last never place same another think house while high right might came off find states since used give
against three himself look few general hand school part small american home during number again mrs around
thought went without however govern don't does got public united point end become head once course fact upon
need system set every war why form show large often though away something less must water asked told best
better data file code model token cache prefix decode prefill request response answer question agent tool call
result value list name type error check test run build start stop open close read write send receive user
system message turn session node cluster engine block memory time fast slow simple sure thanks please yes okay
hello world today weather city temperature sunny cloudy rain wind warm cold hot degrees morning evening night
week month plan task step next previous final search query find found page link source text word number count
total sum average price cost order item product customer account email phone address date report summary
detail note idea reason because therefore thus indeed maybe perhaps likely certainly clearly probably usually
always sometimes rarely let me consider first second third option choice approach method function argument
parameter field object array string integer boolean null true false input output format json line file path
directory update delete create insert select table row column index key map value pair node edge graph tree
route path server client proxy gateway handle hold pull push transfer remote local network host port done
ready waiting running finished failed success failure retry timeout limit budget token tokens look looks
looking seems seemed appear appears use using used based given known called named good bad nice fine great
small big large short long quick easy hard important useful possible add added adds adding remove removed
change changed changes move moved keep kept leave left help helps helped want wants wanted try tries tried
feel feels felt leave begin began begun show shows shown tell tells told ask asks ask need needs needed seem
make makes making made data model models agents tools calls results values names types errors checks tests
runs builds
"""
COMMON_WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())


def _build_vocab() -> list[str]:
    pieces: list[str] = []
    seen: set[str] = set()

    def add(p: str) -> None:
        if p not in seen:
            seen.add(p)
            pieces.append(p)

    for w in COMMON_WORDS:
        if not re.fullmatch(r"[A-Za-z]+", w):
            continue
        for form in (w, w.capitalize(), w.upper()):
            add(form)
            add(" " + form)
    for n in range(1000):
        add(str(n))
        add(" " + str(n))
    for c in "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~":
        add(" " + c)
    # Sub-word pieces for unknown words: every lowercase letter pair, so a word the list lacks still
    # costs about half a token per letter instead of one per byte.
    letters = "abcdefghijklmnopqrstuvwxyz"
    for a in letters:
        for b in letters:
            add(a + b)
            add(" " + a + b)
    return pieces


# Pieces never cross a newline and a space only ever prefixes the next piece: encoding is a pure
# left-to-right function of the text, so concatenations at a newline or special token split cleanly.
_PRETOKEN = re.compile(r"\n| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s")
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_MAX_PIECE = 12

# Segment cache bounds. Agent histories resend the same messages every turn, so the text between two
# special tokens (a message body, a tool result) repeats verbatim and its encoding can be reused. The
# bounds keep a long-running node's memory flat: about 8 MiB of keys plus 8 bytes per cached token.
SEGMENT_CACHE_ENTRIES = 8192
SEGMENT_CACHE_CHARS = 8 * 1024 * 1024
# Pieces (≈ words) that miss the vocabulary are split by a greedy search; identifiers in code and tool
# output recur constantly, so their splits are memoised too (short pieces only: a long base64 run is
# unlikely to recur and would pin memory).
PIECE_CACHE_ENTRIES = 1 << 16
_PIECE_CACHE_MAX_LEN = 64


class Tokenizer:
    """Encode/decode between text and ids; deterministic and safe to share (its caches are memos only)."""

    def __init__(self) -> None:
        self.special_ids: dict[str, int] = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
        self.words: list[str] = _build_vocab()
        self.word_ids: dict[str, int] = {w: _WORD_BASE + i for i, w in enumerate(self.words)}
        self.vocab_size = _WORD_BASE + len(self.words)
        self.eos_id = self.special_ids[IM_END]
        self.bos_id = self.special_ids[ENDOFTEXT]
        # Pure alphabetic vocabulary words, the model's palette for answers.
        self.answer_words: list[str] = sorted({" " + w.lower() for w in COMMON_WORDS if w.isalpha()})
        # Bytes of every id, so decoding (per generated token, in the engine and the parsers) is a lookup.
        self._bytes: list[bytes] = [s.encode() for s in SPECIAL_TOKENS]
        self._bytes += [bytes([b]) for b in range(256)]
        self._bytes += [w.encode() for w in self.words]
        # Encoding memos (see SEGMENT_CACHE_*): they make the tokenizer stateful, so a lock keeps it safe to
        # share between threads (the sim itself runs on one event loop; the lock is uncontended there).
        self._segments: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._segment_chars = 0
        self._pieces: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self.segment_hits = 0  # white-box counters for tests and benchmarks
        self.segment_misses = 0

    def special(self, name: str) -> int:
        return self.special_ids[name]

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < _BYTE_BASE

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        if not allow_special:
            return list(self._encode_segment(text))
        ids: list[int] = []
        # re.split with a capturing group alternates text, special, text, ...: odd indices are specials.
        for i, part in enumerate(_SPECIAL_SPLIT.split(text)):
            if i % 2:
                ids.append(self.special_ids[part])
            elif part:
                ids.extend(self._encode_segment(part))
        return ids

    def _encode_segment(self, text: str) -> tuple[int, ...]:
        """Encoding of text taken as plain text (no special tokens): a pure function of `text`, memoised.

        Splitting at special tokens first is exact (pre-tokenizer pieces never span one), so a prompt's
        encoding is the concatenation of its segments' encodings whether they come from the cache or not.
        """
        if not text:
            return ()
        with self._lock:
            hit = self._segments.get(text)
            if hit is not None:
                self._segments.move_to_end(text)
                self.segment_hits += 1
                return hit
        ids = tuple(self._encode_plain(text))
        with self._lock:
            self.segment_misses += 1
            if len(text) <= SEGMENT_CACHE_CHARS and text not in self._segments:
                self._segments[text] = ids
                self._segment_chars += len(text)
                while len(self._segments) > SEGMENT_CACHE_ENTRIES or self._segment_chars > SEGMENT_CACHE_CHARS:
                    old, _ = self._segments.popitem(last=False)
                    self._segment_chars -= len(old)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = []
        word_ids, pieces = self.word_ids, self._pieces
        for piece in _PRETOKEN.findall(text):
            wid = word_ids.get(piece)
            if wid is not None:
                ids.append(wid)
                continue
            sub = pieces.get(piece)
            if sub is None:
                sub = tuple(_split_piece(self, piece))
                if len(piece) <= _PIECE_CACHE_MAX_LEN:
                    if len(pieces) >= PIECE_CACHE_ENTRIES:
                        # Crude but bounded; the cache refills with what recurs. Single dict operations are
                        # atomic under the GIL, and a lost entry is only recomputed, so no lock is needed.
                        pieces.clear()
                    pieces[piece] = sub
            ids.extend(sub)
        return ids

    def cache_info(self) -> dict[str, int]:
        """Segment-cache statistics (tests, benchmarks, /admin/state)."""
        with self._lock:
            return {
                "segments": len(self._segments),
                "segment_chars": self._segment_chars,
                "hits": self.segment_hits,
                "misses": self.segment_misses,
                "pieces": len(self._pieces),
            }

    def clear_cache(self) -> None:
        with self._lock:
            self._segments.clear()
            self._segment_chars = 0
            self._pieces.clear()

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.vocab_size:
            return self._bytes[token_id]
        return b""

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        table, n = self._bytes, self.vocab_size
        data = b"".join(table[t] for t in ids if 0 <= t < n and not (skip_special and t < _BYTE_BASE))
        try:
            return data.decode("utf-8", errors="surrogatepass")
        except UnicodeDecodeError:
            return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _split_piece(tok: Tokenizer, piece: str) -> Iterable[int]:
    """Greedy longest match against the vocabulary, bytes for the rest (deterministic, so canonical)."""
    if not piece.isascii():
        yield from (_BYTE_BASE + b for b in piece.encode("utf-8", errors="surrogatepass"))
        return
    i = 0
    while i < len(piece):
        for j in range(min(len(piece), i + _MAX_PIECE), i, -1):
            wid = tok.word_ids.get(piece[i:j])
            if wid is not None:
                yield wid
                i = j
                break
        else:
            yield _BYTE_BASE + ord(piece[i])
            i += 1


class IncrementalDetokenizer:
    """Turns a stream of ids into text deltas without splitting a UTF-8 character across deltas."""

    def __init__(self, tok: Tokenizer, *, skip_special: bool = True) -> None:
        self._tok = tok
        self._skip = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token_id: int) -> str:
        if self._skip and self._tok.is_special(token_id):
            return ""
        delta: str = self._decoder.decode(self._tok.token_bytes(token_id))
        self.text += delta
        return delta


@lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    return Tokenizer()
