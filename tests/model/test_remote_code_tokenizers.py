"""Tokenizers whose class is repository code, rebuilt from their files, against the libraries those classes use.

The original Qwen's QWenTokenizer is tiktoken over qwen.tiktoken: the reference is a tiktoken Encoding of the same
ranks, pattern and special tokens. ChatGLM2/3, InternLM2 and Baichuan wrap a sentencepiece model: the reference is
the sentencepiece package on the same model, with the special tokens the classes put around its pieces. Every
vocabulary here is trained on the spot (a byte-level BPE written as tiktoken ranks; sentencepiece BPE models with
each family's options), so nothing is downloaded.
"""

from __future__ import annotations

import base64
import io
import json
import unicodedata
from pathlib import Path

import pytest
import sentencepiece as spm
import tiktoken
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from heteroserve import LLM, SamplingParams
from heteroserve.entrypoints.openai.chat_template import ChatTemplateRenderer
from heteroserve.model.loader import remote_code_tokenizers as rct
from heteroserve.model.loader.remote_code_tokenizers import chat_stop_token_ids, remote_code_tokenizer
from tests.model.remote_code_checkpoints import write_chatglm, write_original_qwen
from tests.model.tiny_models import build_hf_model

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. It's what they'll say, isn't it?",
    "你好，世界！今天天气很好。我们一起去公园散步吧。机器学习和自然语言处理。",
    "def add(x, y):\n    return x + y  # the sum\n\n\tprint(add(20, 22))\n",
    "Numbers 12345 and 3.14159 or 1,000,000; emoji 😀🎉👍 and ✓ marks.",
    "   spaces    and\n\n\nnewlines\r\n and tabs\t\there",
    "sophisticated people stop at the shop; Sophia's laptop",
]
TEXTS = [
    *CORPUS,
    "unseen wörds ünïcödé, 漢字テスト, Ελληνικά, русский ☃",
    "Ｆｕｌｌ ｗｉｄｔｈ and café vs cafe\u0301 (NFC)",
    "    \n  \t x  \n\n\n\n   ",
    "1234567890 00007 3.0e-8",
    "{'key': [1, 2, 3], \"other\": null}\n```python\nfor i in range(10):\n    pass\n```",
    "I'M SHOUTING, YOU'RE LOUD, WE'VE HEARD",
    "a  b   c    d     e",
    "🤖👩‍👩‍👧‍👦🏳️‍🌈",
    "",
    " ",
    "\n",
    "x" * 300,
]


@pytest.fixture(scope="module", autouse=True)
def cache_root(tmp_path_factory) -> Path:
    """The tokenizer cache in a folder of this module's (a folder's tokenizer is built once, then read back)."""
    root = tmp_path_factory.mktemp("tokenizer-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rct, "_cache_root", lambda: root)
        yield root


# The original Qwen


@pytest.fixture(scope="module")
def qwen_ranks() -> dict[bytes, int]:
    """A byte-level BPE trained on CORPUS with Qwen's pattern (256 bytes and ~600 merges), as tiktoken ranks."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(rct.QWEN_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=900, initial_alphabet=alphabet))
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    return {bytes(to_byte[c] for c in token): rank for token, rank in tokenizer.get_vocab().items()}


def _qwen_reference(ranks: dict[bytes, int]):
    """tiktoken as QWenTokenizer builds it (tokenization_qwen.py): the special tokens from id 151643."""
    special = {token: rct.QWEN_SPECIAL_START + i for i, token in enumerate(rct.QWEN_SPECIAL_TOKENS)}
    return tiktoken.Encoding("qwen", pat_str=rct.QWEN_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def write_qwen_tokenizer(folder: Path, ranks: dict[bytes, int]) -> None:
    """Qwen-7B-Chat's tokenizer files: qwen.tiktoken, the auto_map naming QWenTokenizer, its generation_config."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda t: t[1])
    ]
    (folder / "qwen.tiktoken").write_text("".join(lines))
    auto_map = {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}
    config = {"model_max_length": 8192, "tokenizer_class": "QWenTokenizer", "auto_map": auto_map}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    generation = {"chat_format": "chatml", "eos_token_id": 151643, "pad_token_id": 151643, "max_new_tokens": 512}
    (folder / "generation_config.json").write_text(json.dumps(generation))


@pytest.fixture(scope="module")
def qwen_folder(qwen_ranks, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen")
    write_qwen_tokenizer(folder, qwen_ranks)
    return folder


def test_qwen_ids_equal_tiktoken(qwen_ranks, qwen_folder):
    tokenizer = remote_code_tokenizer(qwen_folder)
    reference = _qwen_reference(qwen_ranks)
    specials = "<|im_start|>user\n你好<|im_end|>\n<|extra_0|>x<|extra_204|><|endoftext|> <|im_end|>"
    for text in [*TEXTS, specials, " ".join(TEXTS)]:
        expected = reference.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == expected, text
        assert tokenizer.decode(ids) == reference.decode(expected) == unicodedata.normalize("NFC", text)
        plain = [i for i in expected if i < rct.QWEN_SPECIAL_START]  # QWenTokenizer's skip_special_tokens
        assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(plain)
    assert tokenizer.encode("hi", add_special_tokens=True) == reference.encode("hi")  # Qwen adds no bos / eos
    assert len(tokenizer) == rct.QWEN_SPECIAL_START + 208
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|extra_204|>"]) == [
        151643,
        151644,
        151645,
        151850,
    ]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>", "<|endoftext|>")
    assert tokenizer.model_max_length == 8192
    assert chat_stop_token_ids(tokenizer, qwen_folder) == [151645, 151644]


def test_qwen_tokenizer_is_cached(qwen_ranks, tmp_path, cache_root):
    write_qwen_tokenizer(tmp_path / "qwen", qwen_ranks)
    before = set(cache_root.iterdir())
    first = remote_code_tokenizer(tmp_path / "qwen")
    (cached,) = set(cache_root.iterdir()) - before
    assert (cached / "tokenizer.json").is_file() and (cached / "chat_template.jinja").is_file()
    again = remote_code_tokenizer(tmp_path / "qwen")
    assert again.encode(" ".join(TEXTS)) == first.encode(" ".join(TEXTS))
    assert again.chat_template == first.chat_template and again.eos_token == first.eos_token
    # a changed file is a new key
    (tmp_path / "qwen" / "generation_config.json").write_text(json.dumps({"eos_token_id": 151645}))
    assert remote_code_tokenizer(tmp_path / "qwen").eos_token == "<|im_end|>"


QWEN_CONVERSATION = [
    {"role": "user", "content": "你好"},
    {"role": "assistant", "content": "你好！有什么可以帮你的？"},
    {"role": "user", "content": "Tell me a joke."},
]
# Qwen-7B-Chat's make_context (qwen_generation_utils.py) for this history and query, with chat()'s default system.
QWEN_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n你好<|im_end|>\n"
    "<|im_start|>assistant\n你好！有什么可以帮你的？<|im_end|>\n"
    "<|im_start|>user\nTell me a joke.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _make_context_ids(reference, system: str, history: list[tuple[str, str]], query: str) -> list[int]:
    """make_context's tokens: each role and content encoded on its own, special tokens as ids."""
    start, end, nl = 151644, 151645, reference.encode("\n")

    def turn(role: str, content: str) -> list[int]:
        return [start, *reference.encode(role), *nl, *reference.encode(content), end]

    ids = turn("system", system)
    for q, r in history:
        ids += nl + turn("user", q) + nl + turn("assistant", r)
    return ids + nl + turn("user", query) + nl + [start, *reference.encode("assistant"), *nl]


def test_qwen_chat_template_renders_make_context(qwen_folder):
    tokenizer = remote_code_tokenizer(qwen_folder)
    text = tokenizer.apply_chat_template(QWEN_CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == QWEN_PROMPT
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(system, tokenize=False, add_generation_prompt=True) == expected
    assert tokenizer.apply_chat_template(system, tokenize=False) == expected.removesuffix("\n<|im_start|>assistant\n")

    # through the server's sandboxed renderer too
    renderer = ChatTemplateRenderer(tokenizer, max_chars=10_000)
    job = renderer.job(QWEN_CONVERSATION, add_generation_prompt=True)
    assert renderer.render(job, timeout_s=5.0) == QWEN_PROMPT


def test_qwen_checkpoint_chats_through_llm(qwen_ranks, tmp_path):
    """An original-Qwen checkpoint folder with its tokenizer: LLM.chat renders make_context's prompt, and its
    tokens are make_context's."""
    overrides = {"num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": 151936}
    write_original_qwen(build_hf_model("qwen2", overrides, seed=43), tmp_path / "qwen")
    write_qwen_tokenizer(tmp_path / "qwen", qwen_ranks)
    llm = LLM(model=str(tmp_path / "qwen"), max_model_len=128, num_kv_blocks=32, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    output = llm.chat(QWEN_CONVERSATION, params, use_tqdm=False)[0]
    assert output.prompt == QWEN_PROMPT
    reference = _qwen_reference(qwen_ranks)
    history = [("你好", "你好！有什么可以帮你的？")]
    assert output.prompt_token_ids == _make_context_ids(
        reference, "You are a helpful assistant.", history, "Tell me a joke."
    )
    assert len(output.outputs[0].token_ids) == 3
    assert llm.engine.model.eos_token_id == 151643
    assert llm.engine.model.extra_eos_token_ids == [151645, 151644]  # a chat turn ends at <|im_end|>, as chat() stops


def test_unknown_remote_tokenizer_class_is_refused(tmp_path):
    auto_map = {"AutoTokenizer": ["tokenization_mine.MyTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map}))
    with pytest.raises(ValueError, match="MyTokenizer is repository code"):
        remote_code_tokenizer(tmp_path)
    # transformers' own class named beside the auto_map: AutoTokenizer loads that one, running no repository code
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": auto_map, "tokenizer_class": "LlamaTokenizer"})
    )
    assert remote_code_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert remote_code_tokenizer(tmp_path) is None


def test_broken_qwen_files_are_refused(qwen_ranks, tmp_path):
    write_qwen_tokenizer(tmp_path, qwen_ranks)
    (tmp_path / "qwen.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match=r"qwen.tiktoken:1"):
        remote_code_tokenizer(tmp_path)
    (tmp_path / "qwen.tiktoken").write_text("YQ== 0\n")  # b"a" only: most bytes have no rank
    with pytest.raises(ValueError, match="every byte needs a rank"):
        remote_code_tokenizer(tmp_path)
    write_qwen_tokenizer(tmp_path, qwen_ranks)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen", "visual": {"image_size": 448}}))
    with pytest.raises(ValueError, match="Qwen-VL tokenizer"):
        remote_code_tokenizer(tmp_path)
    (tmp_path / "qwen.tiktoken").unlink()
    with pytest.raises(ValueError, match="qwen.tiktoken, which is missing"):
        remote_code_tokenizer(tmp_path)


# Sentencepiece families


def train_sentencepiece(user_defined: tuple[str, ...] = (), corpus: list[str] = CORPUS, **options) -> bytes:
    """A BPE sentencepiece model trained on `corpus` (byte fallback unless told otherwise)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus * 10),
        model_writer=model,
        model_type="bpe",
        vocab_size=options.pop("vocab_size", 700),
        hard_vocab_limit=False,
        character_coverage=1.0,
        byte_fallback=options.pop("byte_fallback", True),
        user_defined_symbols=list(user_defined),
        minloglevel=2,
        **options,
    )
    return model.getvalue()


def write_sentencepiece_folder(folder: Path, model: bytes, tokenizer_class: str, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model)
    module = {"ChatGLMTokenizer": "tokenization_chatglm"}.get(tokenizer_class, "tokenization_x")
    auto_map = {"AutoTokenizer": [f"{module}.{tokenizer_class}", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map, **config}))
    return folder


# Normalizers: Llama's (identity, a dummy prefix), no dummy prefix, runs of spaces collapsed (newlines and tabs
# kept), and NFKC with extra spaces removed and no byte fallback (sentencepiece's defaults).
SENTENCEPIECE_OPTIONS = {
    "identity": {"normalization_rule_name": "identity", "remove_extra_whitespaces": False},
    "no-dummy-prefix": {
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "add_dummy_prefix": False,
    },
    "extra-whitespace-removed": {"normalization_rule_name": "identity"},
    "nfkc": {"normalization_rule_name": "nmt_nfkc", "byte_fallback": False, "vocab_size": 400},
}


@pytest.mark.parametrize("options", list(SENTENCEPIECE_OPTIONS))
def test_sentencepiece_ids_equal_sentencepiece(options, tmp_path):
    model = train_sentencepiece(**SENTENCEPIECE_OPTIONS[options])
    folder = write_sentencepiece_folder(tmp_path, model, "InternLM2Tokenizer", add_bos_token=False)
    tokenizer = remote_code_tokenizer(folder)
    reference = spm.SentencePieceProcessor(model_proto=model)
    for text in [*TEXTS, " ".join(TEXTS)]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        if reference.unk_id() not in ids:  # sentencepiece writes an unknown piece as " ⁇ "
            assert tokenizer.decode(ids) == reference.decode(ids), text
    assert len(tokenizer) == reference.get_piece_size()


def _pieces_reference(reference, segments: list[str | int]) -> list[int]:
    """What the repositories' classes encode: each text between special tokens on its own, special tokens as ids."""
    ids = []
    for segment in segments:
        ids += [segment] if isinstance(segment, int) else reference.encode(segment)
    return ids


# ChatGLM3's tokenizer_config.json chat template, and its build_chat_input as the reference for its tokens:
# https://huggingface.co/THUDM/chatglm3-6b/blob/103caa40027ebfd8450289ca2f278eac4ff26405/tokenizer_config.json#L42
CHATGLM3_TEMPLATE = (
    "{% for message in messages %}{% if loop.first %}[gMASK]sop<|{{ message['role'] }}|>\n {{ message['content'] }}"
    "{% else %}<|{{ message['role'] }}|>\n {{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "你好，世界"},
    {"role": "assistant", "content": "Hello! What's up?"},
    {"role": "user", "content": "Tell me about the shop."},
]


def test_chatglm3_tokenizer(tmp_path):
    """ChatGLM3's special tokens follow the sentencepiece pieces, and the chat template's text is tokenized as its
    build_chat_input builds the ids. (Trained without CORPUS's last line, so that no piece is named "sop".)"""
    options = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False}
    model = train_sentencepiece(corpus=CORPUS[:-1], **options)
    folder = write_sentencepiece_folder(tmp_path, model, "ChatGLMTokenizer", chat_template=CHATGLM3_TEMPLATE)
    tokenizer = remote_code_tokenizer(folder)
    reference = spm.SentencePieceProcessor(model_proto=model)
    n = reference.get_piece_size()
    names = [*rct.CHATGLM_SPECIAL_TOKENS, *rct.CHATGLM3_ROLE_TOKENS]
    assert tokenizer.convert_tokens_to_ids(names) == list(range(n, n + 9))  # after the sentencepiece pieces
    gmask, sop, system, user, assistant, observation = n + 1, n + 3, n + 5, n + 6, n + 7, n + 8
    for text in TEXTS:  # every text prefixed with [gMASK] sop; "sop" inside words stays text
        assert tokenizer.encode(text) == [gmask, sop, *reference.encode(text)], text
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("</s>", "<unk>")
    assert chat_stop_token_ids(tokenizer, folder) == [user, observation]

    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == (
        "[gMASK]sop<|system|>\n You are a helpful assistant.<|user|>\n 你好，世界<|assistant|>\n Hello! What's up?"
        "<|user|>\n Tell me about the shop.<|assistant|>"
    )
    # build_chat_input: [gMASK] sop, then per message its role token, encode(metadata + "\n"), encode(content)
    segments = [gmask, sop]
    for message in CONVERSATION:
        segments += [{"system": system, "user": user, "assistant": assistant}[message["role"]], "\n"]
        segments.append(message["content"])
    expected = _pieces_reference(reference, [*segments, assistant])
    assert tokenizer.encode(text, add_special_tokens=False) == expected


def test_chatglm3_checkpoint_chats_through_llm(tmp_path):
    """A ChatGLM3 checkpoint folder with its tokenizer: LLM.chat's prompt is build_chat_input's ids, and a text
    prompt starts with [gMASK] sop."""
    glm = {
        "attention_bias": True,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 2e4, "partial_rotary_factor": 0.5},
        "vocab_size": 1024,
    }
    write_chatglm(build_hf_model("glm", glm, seed=44), tmp_path / "glm")
    options = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False}
    model = train_sentencepiece(corpus=CORPUS[:-1], **options)
    write_sentencepiece_folder(tmp_path / "glm", model, "ChatGLMTokenizer", chat_template=CHATGLM3_TEMPLATE)
    reference = spm.SentencePieceProcessor(model_proto=model)
    n = reference.get_piece_size()
    llm = LLM(model=str(tmp_path / "glm"), max_model_len=128, num_kv_blocks=32, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    messages = [{"role": "user", "content": "Hello there"}]
    output = llm.chat(messages, params, use_tqdm=False)[0]
    assert output.prompt == "[gMASK]sop<|user|>\n Hello there<|assistant|>"
    assert output.prompt_token_ids == _pieces_reference(reference, [n + 1, n + 3, n + 6, "\n", "Hello there", n + 7])
    text = llm.generate("Hello there", params, use_tqdm=False)[0]
    assert text.prompt_token_ids == [n + 1, n + 3, *reference.encode("Hello there")]
    assert llm.engine.model.eos_token_id == reference.eos_id()


def test_chatglm_needs_its_sentencepiece_model(tmp_path):
    write_sentencepiece_folder(tmp_path, b"", "ChatGLMTokenizer")
    (tmp_path / "tokenizer.model").unlink()
    with pytest.raises(ValueError, match="ChatGLMTokenizer tokenizer reads tokenizer.model, which is missing"):
        remote_code_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\xff not a model")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        remote_code_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(train_sentencepiece(("<|user|>",), normalization_rule_name="identity"))
    with pytest.raises(ValueError, match=r"pieces named as ChatGLM's special tokens: \['<\|user\|>'\]"):
        remote_code_tokenizer(tmp_path)


def test_chatglm_sop_beside_a_piece_named_sop(tmp_path):
    """A piece named "sop" keeps its id in text; the special token is then written <sop>, in the template too."""
    corpus = [*CORPUS, "asop bsop csop dsop esop fsop gsop"]
    model = train_sentencepiece(corpus=corpus, normalization_rule_name="identity", remove_extra_whitespaces=False)
    folder = write_sentencepiece_folder(tmp_path, model, "ChatGLMTokenizer", chat_template=CHATGLM3_TEMPLATE)
    tokenizer = remote_code_tokenizer(folder)
    reference = spm.SentencePieceProcessor(model_proto=model)
    n = reference.get_piece_size()
    assert reference.piece_to_id("sop") != reference.unk_id()
    assert tokenizer.encode("a sop b") == [n + 1, n + 3, *reference.encode("a sop b")]
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "[gMASK]<sop><|user|>\n hi<|assistant|>"
    expected = _pieces_reference(reference, [n + 1, n + 3, n + 6, "\n", "hi", n + 7])
    assert tokenizer.encode(text, add_special_tokens=False) == expected


# InternLM2-chat's format (lagent's INTERNLM2_META, and the chat_template of internlm2-chat-7b's
# tokenizer_config.json): https://github.com/InternLM/lagent/blob/main/lagent/llms/meta_template.py
INTERNLM2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
INTERNLM2_TOKENS = ("<|plugin|>", "<|interpreter|>", "<|action_end|>", "<|action_start|>", "<|im_end|>", "<|im_start|>")


def test_internlm2_tokenizer(tmp_path):
    """InternLM2's chat tokens are pieces of its model, listed in tokenizer_config.json's added_tokens_decoder."""
    model = train_sentencepiece(INTERNLM2_TOKENS, normalization_rule_name="identity", remove_extra_whitespaces=False)
    reference = spm.SentencePieceProcessor(model_proto=model)
    added = {str(reference.piece_to_id(t)): {"content": t, "special": True} for t in ("<unk>", "<s>", "</s>")}
    added |= {str(reference.piece_to_id(t)): {"content": t, "special": True} for t in INTERNLM2_TOKENS}
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "</s>",
        "unk_token": "<unk>",
        "added_tokens_decoder": added,
        "chat_template": INTERNLM2_TEMPLATE,
    }
    folder = write_sentencepiece_folder(tmp_path, model, "InternLM2Tokenizer", **config)
    tokenizer = remote_code_tokenizer(folder)
    bos, start, end = reference.bos_id(), reference.piece_to_id("<|im_start|>"), reference.piece_to_id("<|im_end|>")
    for text in TEXTS:
        assert tokenizer.encode(text) == [bos, *reference.encode(text)], text  # add_bos_token's default
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "</s>")
    assert len(tokenizer) == reference.get_piece_size()

    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    segments = [bos]
    for message in CONVERSATION:
        segments += [start, f"{message['role']}\n{message['content']}", end, "\n"]
    expected = _pieces_reference(reference, [*segments, start, "assistant\n"])
    assert tokenizer.encode(text, add_special_tokens=False) == expected


def test_internlm2_added_token_at_a_taken_id_is_refused(tmp_path):
    model = train_sentencepiece(normalization_rule_name="identity")
    added = {"5": {"content": "<|im_start|>", "special": True}}
    folder = write_sentencepiece_folder(tmp_path, model, "InternLM2Tokenizer", added_tokens_decoder=added)
    with pytest.raises(ValueError, match="adds '<|im_start|>' at id 5"):
        remote_code_tokenizer(folder)


def test_baichuan2_tokenizer(tmp_path):
    """Baichuan2's roles are two reserved pieces named by generation_config; its build_chat_input is the reference:
    encode(system), then per message its role's token and encode(content), then the assistant's token."""
    reserved = ("<reserved_106>", "<reserved_107>")
    options = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False, "add_dummy_prefix": False}
    model = train_sentencepiece(reserved, **options)
    reference = spm.SentencePieceProcessor(model_proto=model)
    user, assistant = (reference.piece_to_id(t) for t in reserved)
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    folder = write_sentencepiece_folder(tmp_path, model, "BaichuanTokenizer", **config)
    generation = {"user_token_id": user, "assistant_token_id": assistant, "eos_token_id": reference.eos_id()}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    tokenizer = remote_code_tokenizer(folder)
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text), text
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")

    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == (
        "You are a helpful assistant.<reserved_106>你好，世界<reserved_107>Hello! What's up?"
        "<reserved_106>Tell me about the shop.<reserved_107>"
    )
    segments = [CONVERSATION[0]["content"]]
    for message in CONVERSATION[1:]:
        segments += [user if message["role"] == "user" else assistant, message["content"]]
    expected = _pieces_reference(reference, [*segments, assistant])
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    ends_with_assistant = CONVERSATION[:3]
    rendered = tokenizer.apply_chat_template(ends_with_assistant, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("Hello! What's up?")
