"""Each token of a Hugging Face fast tokenizer as the bytes it spells, and its special tokens by role: the common ground
on which a student's and a teacher's token ids are compared when their tokenizers differ (`alignment.py`).

Two tokenizers that differ agree on nothing but the text: the same bytes, cut at different places. So every token is
given its bytes, from the rule its tokenizer spells text with:

- byte-level BPE (GPT-2's byte-to-unicode alphabet: SmolLM2, Llama 3, Qwen): each character of a token stands for one
  byte;
- SentencePiece-style with byte fallback (Gemma 3, Llama 2): `▁` is a space, `<0xNN>` is the byte NN, and any other
  piece is its UTF-8 text.

A tokenizer of neither kind (WordPiece, SentencePiece without byte fallback) spells text outside its vocabulary as
`<unk>`, so its tokens do not give the text's bytes back: it is refused.

Special tokens (`<|im_end|>`, `<bos>`) spell no text: they are compared by the ROLE the tokenizer gives them (its
`bos_token`, `eos_token`, `pad_token`, `unk_token`, and the start- and end-of-turn tokens its chat template writes),
never by their strings: SmolLM2's `<|im_end|>` and Gemma's `<end_of_turn>` both end a turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from jinja2 import TemplateError

# A special token holding several roles (SmolLM2's <|im_end|> is its eos, its pad and its end of turn) stands, for
# another tokenizer, for the first of them, in this order, that the other tokenizer has: the chat-template roles
# first, as the most specific.
SPECIAL_TOKEN_ROLES = ("end_of_turn", "start_of_turn", "bos", "eos", "pad", "unk")
ATTRIBUTE_ROLES = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "pad_token_id", "unk": "unk_token_id"}

BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"  # ▁

# Message contents that no chat template writes by itself, to find where it puts a turn's start and end
USER_MARKER, ASSISTANT_MARKER = "statelens-user-message", "statelens-assistant-message"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode alphabet, read backwards: character -> byte. The printable bytes stand for
    themselves; the other 68 (controls, space, 127-160, 173) take the characters from U+0100 on, in byte order, so
    that every byte is one visible, non-space character and a BPE vocabulary of strings covers all bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(byte): byte for byte in printable}
    others = [byte for byte in range(256) if byte not in set(printable)]
    alphabet.update({chr(256 + n): byte for n, byte in enumerate(others)})
    return alphabet


@dataclass(frozen=True)
class ByteVocabulary:
    """A tokenizer's ids as bytes and roles. `token_bytes[id]` is the token's bytes, `None` for a special token (and
    for an id the tokenizer has no token at); `roles[id]` are a special token's roles, most specific first (empty for
    a special token with none, as SmolLM2's `<repo_name>`); `byte_fallback_ids` are the `<0xNN>` tokens, which
    share their byte with a piece the tokenizer spells that byte with whenever it has one."""

    name: str
    token_bytes: tuple[bytes | None, ...]
    roles: dict[int, tuple[str, ...]]
    special_contents: dict[int, str]
    byte_fallback_ids: frozenset[int]

    def __len__(self) -> int:
        return len(self.token_bytes)

    def role_id(self, role: str) -> int | None:
        """The special token that holds `role`, if one does."""
        return next((token_id for token_id, roles in self.roles.items() if role in roles), None)

    def same_tokenizer(self, other: ByteVocabulary) -> bool:
        """Whether both are one tokenizer: then every special token, roles or none, means the same to both."""
        return self.token_bytes == other.token_bytes and self.special_contents == other.special_contents


def byte_vocabulary(tokenizer, name: str | None = None) -> ByteVocabulary:
    """Every id of a Hugging Face fast `tokenizer` as its bytes, and its special tokens' roles. `name` (default: the
    tokenizer's `name_or_path`) is what error messages call it. Builds in about a second for a 262k vocabulary."""
    name = name or getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"tokenizer {name!r} is not a fast (Rust `tokenizers`) tokenizer, so its spelling rules cannot be read: "
            "load it with `AutoTokenizer.from_pretrained(...)`, which gives the fast one when a tokenizer.json exists"
        )
    added_tokens = tokenizer.added_tokens_decoder
    special_ids = special_token_ids(tokenizer)
    added_texts = {token.content for token in added_tokens.values() if not token.special}
    spell = token_speller(backend, name)
    vocab = backend.get_vocab(with_added_tokens=True)
    token_bytes: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    byte_fallback_ids = set()
    for token, token_id in vocab.items():
        if token_id in special_ids:
            continue
        if token in added_texts:  # matched in the raw text before the model runs: its content is the text itself
            token_bytes[token_id] = token.encode("utf-8")
            continue
        token_bytes[token_id] = spell(token)
        if BYTE_FALLBACK_TOKEN.fullmatch(token):
            byte_fallback_ids.add(token_id)
    roles = special_token_roles(tokenizer, special_ids)
    special_contents = {token_id: backend.id_to_token(token_id) for token_id in special_ids}
    return ByteVocabulary(name, tuple(token_bytes), roles, special_contents, frozenset(byte_fallback_ids))


def component_types(part) -> set[str]:
    """The `type` of a tokenizer.json component and of every component nested in it (a `Sequence`'s)."""
    if isinstance(part, dict):
        nested = {t for value in part.values() for t in component_types(value)}
        return nested | ({part["type"]} if "type" in part else set())
    if isinstance(part, list):
        return {t for value in part for t in component_types(value)}
    return set()


def component_spec(component) -> dict | None:
    """A `tokenizers` decoder's or pre-tokenizer's tokenizer.json entry: its pickled state is that JSON. (Reading the
    whole tokenizer.json instead parses the vocabulary and merges too: 2 s for Gemma 3's 262k tokens.)"""
    return None if component is None else json.loads(component.__getstate__())


def token_speller(backend, name: str):
    """The function from a (non-added) token string to its bytes, by the kind of the Rust tokenizer `backend`; a
    ValueError for a kind whose tokens do not spell every text's bytes."""
    decoder = component_spec(backend.decoder)
    decoding = component_types(decoder) | component_types(component_spec(backend.pre_tokenizer))
    model_kind = type(backend.model).__name__
    if "ByteLevel" in decoding:
        alphabet = byte_level_alphabet()

        def spell_byte_level(token: str) -> bytes:
            try:
                return bytes(alphabet[character] for character in token)
            except KeyError as error:
                raise ValueError(
                    f"tokenizer {name!r} decodes with GPT-2's byte-level alphabet, but its token {token!r} has the "
                    f"character {error.args[0]!r}, which stands for no byte: the vocabulary does not match its "
                    "decoder. Repair or re-save the tokenizer (tokenizer.json) so that its tokens use the byte alphabet"
                ) from None

        return spell_byte_level
    if getattr(backend.model, "byte_fallback", False):
        space_marked = "Metaspace" in decoding or SENTENCEPIECE_SPACE in json.dumps(decoder, ensure_ascii=False)

        def spell_sentencepiece(token: str) -> bytes:
            byte = BYTE_FALLBACK_TOKEN.fullmatch(token)
            if byte:
                return bytes([int(byte.group(1), 16)])
            return (token.replace(SENTENCEPIECE_SPACE, " ") if space_marked else token).encode("utf-8")

        return spell_sentencepiece
    raise ValueError(
        f"tokenizer {name!r} ({model_kind}) cannot give its tokens bytes: it is neither "
        "byte-level BPE (GPT-2's byte alphabet) nor SentencePiece with byte fallback (<0xNN> tokens), so text outside "
        "its vocabulary becomes <unk> and its tokens do not spell the text back. Cross-tokenizer distillation needs "
        "byte-grounded tokens on both sides: use a byte-level or byte-fallback tokenizer (SmolLM2, Llama 3, Qwen, "
        "Gemma 3)"
    )


def special_token_ids(tokenizer) -> set[int]:
    """Every id the tokenizer treats as special: its named special tokens and the added tokens flagged special. A
    GGUF-converted tokenizer (Gemma 3's) flags its turn tokens special without naming them, so `all_special_ids`
    alone misses `<end_of_turn>`."""
    added = {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)


def chat_turn_tokens(tokenizer, special_ids: set[int]) -> dict[str, int]:
    """The special tokens that start and end a turn in the tokenizer's chat template (ChatML: <|im_start|> and
    <|im_end|>; Gemma: <start_of_turn> and <end_of_turn>), found by rendering a user and an assistant message: the
    token just after each message's text ends the turn, the last one before it starts it. A token counts only when
    both messages agree on it, so a template that writes turns without special tokens gives none."""
    if not getattr(tokenizer, "chat_template", None):
        return {}
    messages = [{"role": "user", "content": USER_MARKER}, {"role": "assistant", "content": ASSISTANT_MARKER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except (TemplateError, ValueError):  # a template that refuses this plain exchange names no turn tokens
        return {}
    if not isinstance(text, str) or text.count(USER_MARKER) != 1 or text.count(ASSISTANT_MARKER) != 1:
        return {}

    def specials(piece: str) -> list[int]:
        return [i for i in tokenizer(piece, add_special_tokens=False)["input_ids"] if i in special_ids]

    before_user, rest = text.split(USER_MARKER)
    between, after_assistant = rest.split(ASSISTANT_MARKER)
    found = {}
    starts = specials(before_user)[-1:], specials(between)[-1:]
    ends = specials(between)[:1], specials(after_assistant)[:1]
    if starts[0] and starts[0] == starts[1]:
        found["start_of_turn"] = starts[0][0]
    if ends[0] and ends[0] == ends[1]:
        found["end_of_turn"] = ends[0][0]
    return found


def special_token_roles(tokenizer, special_ids: set[int]) -> dict[int, tuple[str, ...]]:
    """Every special id's roles, from the tokenizer's own attributes and chat template, most specific first."""
    held = {token_id: set() for token_id in special_ids}
    for role, attribute in ATTRIBUTE_ROLES.items():
        token_id = getattr(tokenizer, attribute, None)
        if token_id is not None:
            held.setdefault(token_id, set()).add(role)
    for role, token_id in chat_turn_tokens(tokenizer, special_ids).items():
        held.setdefault(token_id, set()).add(role)
    return {token_id: tuple(role for role in SPECIAL_TOKEN_ROLES if role in roles) for token_id, roles in held.items()}


def special_token_map(source: ByteVocabulary, target: ByteVocabulary) -> dict[int, int]:
    """Each special id of `source` that `target` has a counterpart for -> that counterpart: the target's token of the
    first of the source token's roles the target also has. One tokenizer on both sides maps every special token to
    itself. A special token left out (no role, or none the target has) is refused where it is used."""
    if source.same_tokenizer(target):
        return {token_id: token_id for token_id in source.roles}
    mapped = {}
    for token_id, roles in source.roles.items():
        counterparts = [target.role_id(role) for role in roles if target.role_id(role) is not None]
        if counterparts:
            mapped[token_id] = counterparts[0]
    return mapped


def unmapped_special_message(source: ByteVocabulary, target: ByteVocabulary, token_id: int) -> str:
    """Why the special token `token_id` of `source` has no counterpart in `target`, and what to do about it."""
    roles = source.roles.get(token_id, ())
    held = sorted({role for r in target.roles.values() for role in r})
    why = (
        f"its roles ({', '.join(roles)}) are held by no special token of tokenizer {target.name!r} (which has: "
        f"{', '.join(held) or 'none'})"
        if roles
        else "it has no role (it is not the tokenizer's bos, eos, pad or unk token, nor a start or end of turn in its "
        "chat template)"
    )
    return (
        f"special token {source.special_contents.get(token_id)!r} (id {token_id}) of tokenizer {source.name!r} spells "
        f"no text and {why}, so it has no counterpart among {target.name!r}'s tokens. Special tokens are matched by "
        "role, never by string: leave it out of the text both sides read, or give the tokenizers the role it plays "
        "(set `bos_token`/`eos_token`, or a `chat_template` whose turns end with it)"
    )
