"""A GGUF's tokenizer, verified rather than trusted.

transformers converts a GGUF's vocabulary into a fast tokenizer with one converter per architecture, and
some are wrong: its Gemma converter reads Gemma's SentencePiece-BPE scores (score = -merge rank, no merges
list) as Unigram log-probabilities and tokenizes "The capital" as T, h, e, ▁, c, ... The model still loads
and answers, badly. So after conversion the saved tokenizer is checked against a reference built here,
directly from the GGUF's own fields with the `tokenizers` library, the way llama.cpp tokenizes:

- `tokenizer.ggml.model` "gpt2" (byte-level BPE): BPE over `tokens` with `merges` in their order, the
  pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre`, ByteLevel bytes-to-unicode;
- "llama" (SentencePiece BPE): BPE over `tokens` whose merges are the file's `merges` when it has them, or
  else every split of a normal piece into two normal pieces, ranked by the merged piece's score (what
  SentencePiece's BPE encoder does: merge the adjacent pair whose concatenation scores highest), with byte
  fallback, spaces escaped to "▁" (and a leading "▁" when `add_space_prefix`), a ByteFallback + Fuse
  decoder;
- control tokens (`token_type` 3) are special, user-defined ones (4) are matched in the raw text first;
  BOS (and EOS) are added as `add_bos_token` (`add_eos_token`) say.

On fixed text (sentences with digits and non-ASCII) the saved tokenizer must give exactly the reference's
tokens, and decode them back to the text. When it does not and the reference does, the reference is saved
in its place (tokenizer.json with the special tokens and the chat template); when neither does, the model
is refused: a tokenizer nobody checked is not the model the GGUF describes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

# Fixed text the tokenizers are compared on: words with and without a leading space, digits and number
# groups, punctuation, accented Latin, Cyrillic, CJK and an emoji (byte fallback), repeated spaces, a tab
# and line breaks.
VERIFY_TEXTS = (
    "The capital of France is",
    "The capital of France is Paris. It had 2,102,650 inhabitants on 1 January 2023.",
    "Order #00417 ships on 2024-03-15; ref PAY-9973 costs €12.50 (VAT incl.).",
    "Naïve café owners in Zürich, São Paulo and Kraków don't pay 3x more, do they?",
    "Привет, мир! 東京は日本の首都です。 🙂",
    "Two  spaces,\ta tab and\nnew lines.\n\nEnd",
)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
VOCAB_KEYS = frozenset({
    "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
    "tokenizer.chat_template",
})

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), by `tokenizer.ggml.pre`
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2,), "gpt2": (_GPT2,), "mpt": (_GPT2,), "olmo": (_GPT2,),
    "llama3": (_LLAMA3,), "llama-v3": (_LLAMA3,), "llama-bpe": (_LLAMA3,), "falcon3": (_LLAMA3,),
    "qwen2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,),
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
    "command-r": (r"\p{N}", _GPT2), "codeshell": (r"\p{N}", _GPT2),
}
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}  # llama.cpp takes a pre-token whole when it is in the vocabulary


class Unverifiable(Exception):
    """The GGUF's tokenizer cannot be rebuilt (and so nothing can be checked against it)."""


class GgufVocab(NamedTuple):
    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def token(self, index: int | None) -> str | None:
        return self.tokens[index] if index is not None and 0 <= index < len(self.tokens) else None


class TokenizerCheck(NamedTuple):
    """What the check found: the converted tokenizer verified, or replaced by the reference (`repaired`)."""

    model: str
    repaired: bool
    converted_problem: str | None  # why transformers' conversion failed the check, when it did
    texts: int

    def record(self) -> dict[str, Any]:
        return {
            "verified": True, "tokenizer_model": self.model, "texts": self.texts,
            "saved": "reference built from the GGUF's vocabulary" if self.repaired else "transformers' conversion",
            **({"converted_problem": self.converted_problem} if self.converted_problem else {}),
        }


def read_vocab(fields: dict[str, Any]) -> GgufVocab:
    """The tokenizer fields of a GGUF header (as `pipelines.models.gguf` scans them, arrays materialized)."""
    tokens = fields.get("tokenizer.ggml.tokens")
    model = fields.get("tokenizer.ggml.model")
    if not isinstance(model, str) or not isinstance(tokens, list) or not tokens:
        raise Unverifiable("the GGUF has no tokenizer.ggml.model or tokenizer.ggml.tokens")
    types = fields.get("tokenizer.ggml.token_type")
    scores = fields.get("tokenizer.ggml.scores")
    merges = fields.get("tokenizer.ggml.merges")
    for name, values in (("token_type", types), ("scores", scores)):
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)):
            raise Unverifiable(f"tokenizer.ggml.{name} has {len(values) if isinstance(values, list) else '?'} entries for {len(tokens)} tokens")
    if merges is not None and not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise Unverifiable("tokenizer.ggml.merges is not a list of strings")

    def token_id(key: str) -> int | None:
        value = fields.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(tokens) else None

    def flag(key: str, default: bool) -> bool:
        value = fields.get(f"tokenizer.ggml.{key}")
        return bool(value) if isinstance(value, (bool, int)) else default

    spm = model == "llama"
    ids = {name: token_id(f"{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}
    if types is None:  # llama.cpp's defaults: the special ids are control tokens, the rest normal
        types = [CONTROL if i in ids.values() else NORMAL for i in range(len(tokens))]
    template = fields.get("tokenizer.chat_template")
    return GgufVocab(
        model=model, pre=fields.get("tokenizer.ggml.pre") if isinstance(fields.get("tokenizer.ggml.pre"), str) else None,
        tokens=tokens, types=[int(t) for t in types], scores=[float(s) for s in scores] if scores is not None else None,
        merges=merges, bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unknown"], pad_id=ids["padding"],
        # llama.cpp: SentencePiece vocabularies add BOS and a space prefix unless the file says otherwise
        add_bos=flag("add_bos_token", spm), add_eos=flag("add_eos_token", False),
        add_space_prefix=flag("add_space_prefix", spm) if spm else False,
        chat_template=template if isinstance(template, str) else None,
    )


def _vocabulary(vocab: GgufVocab) -> dict[str, int]:
    ids: dict[str, int] = {}
    for index, token in enumerate(vocab.tokens):
        ids.setdefault(token, index)  # llama.cpp's text-to-token map keeps the first of duplicates
    return ids


def _merges_from_scores(vocab: GgufVocab) -> list[tuple[str, str]]:
    """SentencePiece BPE without a merges list: every split of a normal piece into two normal pieces, the
    pair ranked by the merged piece's score (highest first), then by the parts' scores."""
    if vocab.scores is None:
        raise Unverifiable("a SentencePiece vocabulary with neither merges nor scores")
    scores = vocab.scores
    normal: dict[str, int] = {}
    for index, token in enumerate(vocab.tokens):
        if vocab.types[index] == NORMAL:
            normal.setdefault(token, index)
    ranked = []
    for piece, index in normal.items():
        for cut in range(1, len(piece)):
            left, right = normal.get(piece[:cut]), normal.get(piece[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[index], index, -scores[left], -scores[right], piece[:cut], piece[cut:]))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise Unverifiable(f"tokenizer.ggml.merges holds {merge!r}, not two pieces")
        pairs.append((left, right))
    return pairs


def reference_tokenizer(vocab: GgufVocab) -> Any:
    """A `tokenizers.Tokenizer` that tokenizes as the GGUF's own fields say (see the module's docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors  # heavy: imported when used
    from tokenizers.models import BPE  # heavy: imported when used

    ids = _vocabulary(vocab)
    if vocab.model == "gpt2":
        if vocab.merges is None:
            raise Unverifiable("a byte-level BPE vocabulary (tokenizer.ggml.model gpt2) without tokenizer.ggml.merges")
        pre = vocab.pre or "default"
        if pre not in PRE_TOKENIZERS:
            raise Unverifiable(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one this check knows ({', '.join(sorted(PRE_TOKENIZERS))})")
        tokenizer = Tokenizer(BPE(ids, _split_merges(vocab.merges), fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in PRE_TOKENIZERS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
    elif vocab.model == "llama":
        merges = _split_merges(vocab.merges) if vocab.merges is not None else _merges_from_scores(vocab)
        has_bytes = any(t == BYTE for t in vocab.types)
        tokenizer = Tokenizer(BPE(ids, merges, unk_token=vocab.token(vocab.unk_id), fuse_unk=True, byte_fallback=has_bytes))
        escape = [normalizers.Replace(" ", "▁")]
        tokenizer.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if vocab.add_space_prefix else []) + escape)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))
    else:
        raise Unverifiable(f"tokenizer model {vocab.model!r} (tokenizer.ggml.model) is not one this check knows (gpt2, llama)")
    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == USER_DEFINED]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)
    bos, eos = vocab.token(vocab.bos_id), vocab.token(vocab.eos_id)
    if (vocab.add_bos and bos is None) or (vocab.add_eos and eos is None):
        raise Unverifiable("the GGUF adds a BOS/EOS token it does not name (tokenizer.ggml.bos_token_id / eos_token_id)")
    first = [f"{bos}:0"] if vocab.add_bos else []
    last = [f"{eos}:0"] if vocab.add_eos else []
    specials = sorted({(t, ids[t]) for t in (bos if vocab.add_bos else None, eos if vocab.add_eos else None) if t})
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[*first, "$A:0", *last], pair=[*first, "$A:0", *last, *first, "$B:1", *last], special_tokens=specials,
    )
    return tokenizer


def compare(tokenizer: Any, reference: Any, texts: tuple[str, ...] = VERIFY_TEXTS) -> str | None:
    """The first difference between a transformers tokenizer and the reference on `texts`, or None."""
    for text in texts:
        want = reference.encode(text).ids
        got = list(tokenizer(text)["input_ids"])
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            shown = tokenizer.convert_ids_to_tokens(got[: at + 3])
            expected = [reference.id_to_token(i) for i in want[: at + 3]]
            return f"on {text[:40]!r} it gives {len(got)} tokens {shown} ... where the GGUF's vocabulary gives {len(want)}: {expected} ..."
        back = tokenizer.decode(got, skip_special_tokens=True)
        if back != text:
            return f"decode(encode({text[:40]!r})) gives {back[:60]!r}"
    return None


def _round_trip(reference: Any, texts: tuple[str, ...]) -> str | None:
    for text in texts:
        back = reference.decode(reference.encode(text).ids, skip_special_tokens=True)
        if back != text:
            return f"decode(encode({text[:40]!r})) gives {back[:60]!r}"
    return None


def _special_tokens(vocab: GgufVocab) -> dict[str, str]:
    named = {"bos_token": vocab.bos_id, "eos_token": vocab.eos_id, "unk_token": vocab.unk_id, "pad_token": vocab.pad_id}
    return {name: token for name, index in named.items() if (token := vocab.token(index)) is not None}


def save_reference(reference: Any, vocab: GgufVocab, out: Path, chat_template: str | None) -> None:
    """Replace the tokenizer files in `out` with the reference tokenizer, its special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast  # heavy: imported when used

    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "added_tokens.json", "vocab.json", "merges.txt"):
        (out / name).unlink(missing_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=reference, clean_up_tokenization_spaces=False, add_bos_token=vocab.add_bos,
        add_eos_token=vocab.add_eos, **_special_tokens(vocab),
    )
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)


def verify(out: Path, fields: dict[str, Any], *, conversion_error: str | None = None) -> TokenizerCheck:
    """Check the tokenizer saved in `out` against the GGUF's own vocabulary (`fields`), repairing it when the
    reference passes and it does not (or when transformers could not convert it: `conversion_error`).
    Raises Unverifiable with one line when neither can be verified."""
    from transformers import AutoTokenizer  # heavy: imported when used

    vocab = read_vocab(fields)
    reference = reference_tokenizer(vocab)
    saved = AutoTokenizer.from_pretrained(out) if conversion_error is None else None
    problem = compare(saved, reference) if saved is not None else conversion_error
    if problem is None:
        return TokenizerCheck(vocab.model, repaired=False, converted_problem=None, texts=len(VERIFY_TEXTS))
    reference_problem = _round_trip(reference, VERIFY_TEXTS)
    if reference_problem is not None:
        raise Unverifiable(
            f"transformers' tokenizer fails the check ({problem}) and so does the one built from the GGUF's vocabulary ({reference_problem})"
        )
    save_reference(reference, vocab, out, vocab.chat_template or getattr(saved, "chat_template", None))
    again = compare(AutoTokenizer.from_pretrained(out), reference)
    if again is not None:
        raise Unverifiable(f"the tokenizer rebuilt from the GGUF's vocabulary does not reload as saved ({again})")
    return TokenizerCheck(vocab.model, repaired=True, converted_problem=problem, texts=len(VERIFY_TEXTS))
