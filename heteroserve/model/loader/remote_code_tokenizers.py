"""Fast tokenizers for model folders whose tokenizer class is repository code (trust_remote_code), built from data.

heteroserve runs no code from a model folder, so these tokenizers are rebuilt from their files and from what the
repositories' classes add, written here as data: the original Qwen's byte-level BPE ranks (`qwen.tiktoken`) with
its pattern and special tokens, and the sentencepiece `tokenizer.model` of ChatGLM2/3, InternLM2 and Baichuan with
their special tokens, prefixes and chat formats. A tokenizer class named in tokenizer_config.json's auto_map that
is not here is refused by name: building a near miss would tokenize differently without saying so.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode, import_protobuf
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

logger = logging.getLogger(__name__)

# Bumped whenever a builder changes what it builds, so that cached tokenizers are rebuilt.
BUILD_VERSION = 1

# The original Qwen (tokenization_qwen.py in Qwen/Qwen-7B-Chat): the pattern that splits text before BPE, and
# the special tokens at fixed ids from 151643, after the 151643 ranks of qwen.tiktoken.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIAL_START = 151643
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|extra_{i}|>" for i in range(205)))
# Qwen-7B-Chat's make_context (qwen_generation_utils.py): ChatML turns joined by "\n", a default system message.
QWEN_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set turns = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>' }}"
    "{%- for message in turns %}"
    "{{- '\\n<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '\\n<|im_start|>assistant\\n' }}{%- endif %}"
)

# ChatGLM2/3 (tokenization_chatglm.py in THUDM/chatglm2-6b and chatglm3-6b): tokens after the sentencepiece
# vocabulary, in this order (ChatGLM2 stops after eop), and every sequence prefixed with [gMASK] sop.
CHATGLM_SPECIAL_TOKENS = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop")
CHATGLM3_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
CHATGLM_PREFIX = ("[gMASK]", "sop")
# Baichuan2's chat (generation_utils.build_chat_input in baichuan-inc/Baichuan2-7B-Chat): the system text, then
# each user message after generation_config's user_token_id and each assistant message after assistant_token_id,
# then assistant_token_id unless the last message is the assistant's. {user} and {assistant} are those tokens.
BAICHUAN2_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{- '{user}' + message['content'] }}"
    "{%- else %}{{- '{assistant}' + message['content'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt and (not messages or messages[-1]['role'] != 'assistant') %}{{- '{assistant}' }}"
    "{%- endif %}"
)

# sentencepiece's piece types (sentencepiece_model.proto)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPM_BPE = 2


def remote_code_tokenizer(folder: Path) -> PreTrainedTokenizerFast | None:
    """The folder's tokenizer built without its repository's code (cached), or None when AutoTokenizer can load it
    (no auto_map, or tokenizer_class naming a transformers class). Raises ValueError naming the class or the file
    when the tokenizer is repository code that cannot be built here."""
    config = _read_json(folder / "tokenizer_config.json")
    class_name = _remote_class(config)
    if class_name is None:
        if not (folder / "qwen.tiktoken").is_file() or (folder / "tokenizer.json").is_file():
            return None
        class_name = "QWenTokenizer"  # a Qwen folder whose tokenizer_config.json lost its auto_map
    family = _FAMILIES.get(class_name)
    if family is None:
        named = config.get("tokenizer_class")
        if isinstance(named, str) and tokenizer_class_from_name(named.removesuffix("Fast")) is not None:
            return None  # AutoTokenizer takes transformers' class over the repository's, running no code
        raise ValueError(
            f"{folder / 'tokenizer_config.json'}: the tokenizer class {class_name} is repository code (auto_map), "
            f"which heteroserve does not run, and it has no equivalent here (known: {', '.join(sorted(_FAMILIES))}); "
            "add a tokenizer.json or send token ids"
        )
    data_file, build = family
    if not (folder / data_file).is_file():
        raise ValueError(f"{folder}: the {class_name} tokenizer reads {data_file}, which is missing")
    inputs = [folder / name for name in (data_file, "tokenizer_config.json", "generation_config.json", "config.json")]
    return _cached(inputs, lambda: build(folder))


def chat_stop_token_ids(tokenizer: PreTrainedTokenizerFast, folder: Path) -> list[int]:
    """Tokens that end an assistant turn besides eos, as the repositories' chat functions stop: the original Qwen
    on <|im_end|> and <|im_start|> (generation_config chat_format chatml), ChatGLM3 on <|user|> and <|observation|>."""
    vocab = tokenizer.get_vocab()
    if (folder / "qwen.tiktoken").is_file():
        chatml = _read_json(folder / "generation_config.json").get("chat_format") == "chatml"
        return [vocab["<|im_end|>"], vocab["<|im_start|>"]] if chatml else []
    if _remote_class(_read_json(folder / "tokenizer_config.json")) == "ChatGLMTokenizer" and "<|observation|>" in vocab:
        return [vocab["<|user|>"], vocab["<|observation|>"]]
    return []


def _remote_class(config: dict) -> str | None:
    """The tokenizer class named in tokenizer_config.json's auto_map, without its module."""
    auto_map = config.get("auto_map") or {}
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
    if isinstance(entry, str):
        entry = [entry]
    names = [name.rsplit(".", 1)[-1] for name in entry or [] if name]
    return names[0] if names else None


def _cached(inputs: list[Path], build: Callable[[], PreTrainedTokenizerFast]) -> PreTrainedTokenizerFast:
    """Built once per version of its input files: building Qwen's merges takes seconds."""
    stamp = [f"v{BUILD_VERSION}"]
    for path in inputs:
        if path.is_file():
            stat = path.stat()
            stamp.append(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")
    key = hashlib.sha1("\n".join(stamp).encode()).hexdigest()[:16]
    cache = _cache_root() / f"remote-{key}"
    if cache.is_dir():
        return PreTrainedTokenizerFast.from_pretrained(cache)
    tokenizer = build()
    partial = cache.with_name(f"{cache.name}.{os.getpid()}")  # renamed whole: a reader never sees half of it
    try:
        tokenizer.save_pretrained(partial)
        partial.rename(cache)
    except OSError:  # unwritable, or another process cached it first
        shutil.rmtree(partial, ignore_errors=True)
        if not cache.is_dir():
            logger.warning("could not cache the tokenizer in %s", cache)
    return tokenizer


def _cache_root() -> Path:
    return Path.home() / ".cache" / "heteroserve" / "tokenizers"  # beside the GGUF tokenizers load_tokenizer caches


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _merges(ranked: list[str], rank: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges for tokens in rank order: every split of a token into two tokens. Merging the pair of lowest
    rank first, as tiktoken and sentencepiece do (by the rank of what the pair forms), is then what BPE does."""
    merges = []
    for token in ranked:
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in rank and token[i:] in rank]
        merges.extend(sorted(splits, key=lambda pair: (rank[pair[0]], rank[pair[1]])))
    return merges


# The original Qwen


def _qwen(folder: Path) -> PreTrainedTokenizerFast:
    path = folder / "qwen.tiktoken"
    if "visual" in _read_json(folder / "config.json"):
        raise ValueError(f"{folder}: a Qwen-VL tokenizer (image tokens) is not supported; send token ids")
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{number}: not a 'base64(token) rank' line") from e
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing or len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: every byte needs a rank and ranks must be unique (bytes without one: {missing[:8]})")
    if max(ranks.values()) >= QWEN_SPECIAL_START:
        raise ValueError(f"{path}: ranks reach the special tokens' ids (from {QWEN_SPECIAL_START})")

    to_unicode = bytes_to_unicode()  # GPT-2's printable stand-ins for bytes, the byte-level vocabularies' alphabet
    vocab = {"".join(to_unicode[b] for b in token): rank for token, rank in ranks.items()}
    ranked = sorted(vocab, key=vocab.__getitem__)
    # Ids without a rank (a file with fewer ranks than Qwen's) hold strings no byte-level text can form.
    taken = set(vocab.values())
    vocab |= {f"\ue000{i}": i for i in range(QWEN_SPECIAL_START) if i not in taken}
    tokenizer = Tokenizer(models.BPE(vocab, _merges(ranked, vocab), ignore_merges=True, fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()  # QWenTokenizer.tokenize normalises first
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # allowed_special="all": Qwen finds its special tokens in any text
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    assert tokenizer.token_to_id(QWEN_SPECIAL_TOKENS[0]) == QWEN_SPECIAL_START

    generation = _read_json(folder / "generation_config.json")
    eos = _token_of(tokenizer, generation.get("eos_token_id"), "<|endoftext|>")
    pad = _token_of(tokenizer, generation.get("pad_token_id"), eos)
    return _wrap(tokenizer, folder, eos_token=eos, pad_token=pad, chat_template=QWEN_CHAT_TEMPLATE)


def _token_of(tokenizer: Tokenizer, token_id, default: str) -> str:
    if isinstance(token_id, list):
        token_id = token_id[0] if token_id else None
    token = tokenizer.id_to_token(token_id) if isinstance(token_id, int) else None
    return token or default


def _wrap(tokenizer: Tokenizer, folder: Path, **special) -> PreTrainedTokenizerFast:
    config = _read_json(folder / "tokenizer_config.json")
    extra = {"model_max_length": config["model_max_length"]} if "model_max_length" in config else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        clean_up_tokenization_spaces=False,
        **extra,
        **{k: v for k, v in special.items() if v is not None},
    )


# Sentencepiece families


def _sentencepiece(path: Path) -> tuple[Tokenizer, object]:
    """A fast tokenizer giving the ids the sentencepiece package gives for any text (a BPE model: merges by
    piece score, byte fallback, the dummy prefix and whitespace rules of its normalizer), and the parsed model."""
    proto = import_protobuf(f"reading {path}").ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:
        raise ValueError(f"{path}: not a sentencepiece model ({e})") from e
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != _SPM_BPE:
        raise ValueError(f"{path}: a sentencepiece model of type {trainer.model_type}; only BPE models are supported")
    if trainer.treat_whitespace_as_suffix or not norm.escape_whitespaces:
        raise ValueError(f"{path}: sentencepiece whitespace options (suffix or unescaped spaces) are not supported")
    pieces = list(proto.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    score = {p.piece: -p.score for p in pieces if p.type == _NORMAL}  # the highest score is merged first
    ranked = sorted(score, key=lambda piece: (score[piece], vocab[piece]))
    unk = _piece(proto, trainer.unk_id)
    bpe = models.BPE(vocab, _merges(ranked, score), unk_token=unk, fuse_unk=True, byte_fallback=trainer.byte_fallback)
    tokenizer = Tokenizer(bpe)
    steps = []
    if norm.precompiled_charsmap:  # tokenizers' reading of it differs on rare combining marks: say so
        logger.warning(
            "%s normalises text with a character map (%s); a few rare characters may differ", path, norm.name
        )
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:  # spaces only: sentencepiece keeps newlines and tabs
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    # Each text between special tokens gets the dummy prefix, as the repositories' classes encode each on its own
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    # sentencepiece matches user-defined pieces whole in text (the text after one gets a dummy prefix here, as after
    # a special token); control pieces (<s>, </s>) are special here, so that a chat template may write them
    tokenizer.add_tokens([AddedToken(p.piece, normalized=False) for p in pieces if p.type == _USER_DEFINED])
    controls = [AddedToken(p.piece, special=True, normalized=False) for p in pieces if p.type == _CONTROL]
    tokenizer.add_special_tokens(controls)
    return tokenizer, proto


def _piece(proto, index: int) -> str | None:
    return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None


def _prefix_and_suffix(tokenizer: Tokenizer, first: list[str], last: list[str]) -> None:
    """What encode adds around every text (add_special_tokens=True)."""
    if first or last:
        ids = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(first + last)]
        single = " ".join([*first, "$A", *last])
        pair = " ".join([*first, "$A", *last, "$B:1", *last])
        tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


def _chatglm(folder: Path) -> PreTrainedTokenizerFast:
    """ChatGLM2/3: sentencepiece, then [MASK] [gMASK] [sMASK] sop eop and ChatGLM3's role tokens (added always:
    past ChatGLM2's they move no id); eos </s>, pad <unk>; every text prefixed with [gMASK] sop. The chat template
    is tokenizer_config.json's (ChatGLM3's has one); ChatGLM2 has none."""
    path = folder / "tokenizer.model"
    tokenizer, proto = _sentencepiece(path)
    names = {t: t for t in CHATGLM_SPECIAL_TOKENS + CHATGLM3_ROLE_TOKENS}
    for word in ("sop", "eop"):  # a fast tokenizer gives an added token the id of a piece of the same name
        if tokenizer.token_to_id(word) is not None:
            names[word] = f"<{word}>"
            logger.warning("%s has a piece named %s: ChatGLM's %s token is written <%s> here", path, word, word, word)
    taken = [t for t in names.values() if tokenizer.token_to_id(t) is not None]
    if taken:
        raise ValueError(f"{path} has pieces named as ChatGLM's special tokens: {taken}")
    # sop / eop are words: matched only where they stand alone ("[gMASK]sop<|user|>"), not inside "sophisticated"
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, single_word=t in ("sop", "eop")) for t in names.values()]
    )
    _prefix_and_suffix(tokenizer, [names[t] for t in CHATGLM_PREFIX], [])
    template = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if template is not None:
        template = template.replace("[gMASK]sop", names["[gMASK]"] + names["sop"])
    eos, unk = _piece(proto, proto.trainer_spec.eos_id), _piece(proto, proto.trainer_spec.unk_id)
    return _wrap(tokenizer, folder, eos_token=eos, pad_token=unk, unk_token=unk, chat_template=template)


def _llama_like(folder: Path) -> PreTrainedTokenizerFast:
    """InternLM2 and Baichuan: Llama-like sentencepiece tokenizers. tokenizer_config.json says their added tokens,
    special tokens, add_bos_token / add_eos_token and (InternLM2-chat) chat template; Baichuan2's chat format is
    built from generation_config's user_token_id and assistant_token_id."""
    path = folder / "tokenizer.model"
    tokenizer, proto = _sentencepiece(path)
    config = _read_json(folder / "tokenizer_config.json")
    for token_id, entry in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
        known = tokenizer.token_to_id(entry["content"])
        if (known if known is not None else tokenizer.get_vocab_size()) != int(token_id):
            raise ValueError(
                f"{folder}: tokenizer_config.json adds {entry['content']!r} at id {token_id}, "
                f"where {path.name} has {tokenizer.id_to_token(int(token_id))!r}"
            )
        special = entry.get("special", True)
        token = AddedToken(entry["content"], special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    special = {}
    defaults = {
        "bos_token": proto.trainer_spec.bos_id,
        "eos_token": proto.trainer_spec.eos_id,
        "unk_token": proto.trainer_spec.unk_id,
    }
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name, _piece(proto, defaults.get(name, -1)))
        special[name] = value.get("content") if isinstance(value, dict) else value
    template = config.get("chat_template")
    generation = _read_json(folder / "generation_config.json")
    if template is None and "user_token_id" in generation and "assistant_token_id" in generation:
        roles = {}
        for role in ("user", "assistant"):
            token = tokenizer.id_to_token(generation[f"{role}_token_id"])
            if token is None:
                raise ValueError(f"{folder}: generation_config.json's {role}_token_id is not in {path.name}")
            tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)])
            roles[role] = token
        template = BAICHUAN2_CHAT_TEMPLATE.replace("{user}", roles["user"]).replace("{assistant}", roles["assistant"])
    first = [special["bos_token"]] if config.get("add_bos_token", True) and special["bos_token"] else []
    last = [special["eos_token"]] if config.get("add_eos_token", False) and special["eos_token"] else []
    _prefix_and_suffix(tokenizer, first, last)
    return _wrap(tokenizer, folder, chat_template=template, **special)


# tokenizer class -> (the file it reads, the builder)
_FAMILIES: dict[str, tuple[str, Callable[[Path], PreTrainedTokenizerFast]]] = {
    "QWenTokenizer": ("qwen.tiktoken", _qwen),
    "ChatGLMTokenizer": ("tokenizer.model", _chatglm),
    "InternLM2Tokenizer": ("tokenizer.model", _llama_like),
    "InternLM2TokenizerFast": ("tokenizer.model", _llama_like),
    "BaichuanTokenizer": ("tokenizer.model", _llama_like),
    "BaiChuanTokenizer": ("tokenizer.model", _llama_like),
}
