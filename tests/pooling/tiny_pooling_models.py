"""Tiny randomly initialised pooling checkpoints (embedding models and cross-encoders), each with a real tokenizer.

Every builder writes a float32 checkpoint from a fixed seed into a folder, laid out the way sentence-transformers
saves it, so `SentenceTransformer(folder)` / `CrossEncoder(folder)` are the references. Weights are drawn large
(tests/model/tiny_models.py `randomize`): with default init every text's embedding is nearly the same vector and
two engines agree whatever they compute. The tokenizers are trained here on a generated English-like corpus, so
texts become a dozen or more meaningful tokens and pairs get their architecture's template (BERT's token_type_ids,
XLM-R's `</s></s>` separator, Qwen3-Embedding's closing `<|endoftext|>`).
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    BertTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Tokenizer,
    XLMRobertaTokenizer,
)

from tests.model.tiny_models import COMMON, SPECS

TOKENIZER_VOCAB = 320
ENCODER_MAX_POSITIONS = 128
MATRYOSHKA_DIMENSIONS = [16, 32, 64]
QWEN3_PROMPTS = {"query": "Instruct: Given a question, retrieve passages that answer it\nQuery: ", "document": ""}
# ChatML, as Qwen's chat models write turns; roles other than system / user / assistant pass through as they are.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON_WORDS = (
    "the a of and to in is was for on that with as by at from it be this are have or an they which one you were all "
    "we her she there would their will when who him been has more if no out so said what up its about into than them "
    "can only other new some could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came right "
    "used take three river mountain garden letter window bright quiet music paper summer winter morning evening"
)
WORDS = _COMMON_WORDS.split()


def english_like_text(rng: random.Random, min_words: int = 3, max_words: int = 14) -> str:
    """One sentence of common English words (the corpus the tokenizers learn, and the tests' texts)."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
    return words[0].upper() + words[1:] + rng.choice(".?!.")


def sample_texts(seed: int, n: int, min_words: int = 3, max_words: int = 40) -> list[str]:
    """n texts of mixed lengths, the same for a seed."""
    rng = random.Random(seed)
    return [english_like_text(rng, min_words, max_words) for _ in range(n)]


def sample_pairs(seed: int, n: int) -> list[tuple[str, str]]:
    """n (query, document) pairs: a short question and a longer passage."""
    rng = random.Random(seed)
    return [(english_like_text(rng, 3, 8), english_like_text(rng, 8, 40)) for _ in range(n)]


def _corpus() -> list[str]:
    rng = random.Random(1234)
    return [english_like_text(rng) for _ in range(3000)]


def bert_tokenizer() -> BertTokenizer:
    """A lower-casing WordPiece tokenizer: [CLS] a [SEP] (b [SEP]) with token_type_ids 0 / 1, as BERT's.

    The vocabulary is written out, not trained: `WordPieceTrainer` breaks ties between equally frequent merges in
    hash order, so each process learned a different vocabulary and every test's numbers moved with it. Words of up
    to six letters are whole tokens; longer ones are a four-letter piece and a `##` continuation, so WordPiece's
    splitting is exercised; single characters (and their `##` forms) cover anything else."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    characters = sorted(set("".join(WORDS)) | set(".?!,"))
    pieces: list[str] = []
    for word in WORDS:
        pieces += [word] if len(word) <= 6 else [word[:4], "##" + word[4:]]
    vocab = list(dict.fromkeys([*specials, *characters, *("##" + c for c in characters), *pieces]))
    assert len(vocab) <= TOKENIZER_VOCAB
    return BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, model_max_length=ENCODER_MAX_POSITIONS)


def xlmr_tokenizer() -> XLMRobertaTokenizer:
    """A Unigram (SentencePiece-style) tokenizer with XLM-R's special ids (<s> 0, <pad> 1, </s> 2, <unk> 3) and its
    pair template <s> a </s></s> b </s>."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>"
    )
    tok.train_from_iterator(_corpus(), trainer)
    # The trainer gives the single characters it must keep scores a hair apart in hash order, so each process
    # learned different ids: scores rounded to 0.01 and ties sorted by piece make the vocabulary the same everywhere.
    learned = [(piece, round(score, 2)) for piece, score in json.loads(tok.to_str())["model"]["vocab"]]
    specials, pieces = learned[:5], learned[5:]
    vocab = specials + sorted(pieces, key=lambda entry: (-entry[1], entry[0]))
    return XLMRobertaTokenizer(vocab=vocab, model_max_length=ENCODER_MAX_POSITIONS)


def qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer whose post-processor appends <|endoftext|>, as Qwen3-Embedding's does: the last
    token, which the model pools, is then the same marker after every text."""
    eos = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=eos,
        pad_token=eos,
        model_max_length=COMMON["max_position_embeddings"],
    )
    eos_id = tokenizer.convert_tokens_to_ids(eos)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B:1 {eos}:1", special_tokens=[(eos, eos_id)]
    )
    return tokenizer


def chat_qwen_tokenizer() -> Qwen2Tokenizer:
    """qwen_tokenizer with ChatML's <|im_start|> / <|im_end|> markers and chat template."""
    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


@torch.no_grad()
def randomize_encoder(model: PreTrainedModel, seed: int, std: float = 0.2, query_key_std: float = 0.4) -> None:
    """Fixed-seed weights: matrices and biases N(0, std), embeddings N(0, 0.5), LayerNorm / RMSNorm gains N(1, 0.2).

    BERT-style query / key projections get query_key_std: sharper attention keeps tokens apart, where diffuse
    attention and GELU's positive mean make every mean-pooled text nearly the same vector (pairwise cosine 0.8-0.98
    at 0.2, 0.35-0.9 at 0.4)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if param.ndim == 1 and name.endswith(".weight"):
            param.copy_(1.0 + 0.2 * noise)
        elif "embed" in name:
            param.copy_(0.5 * noise)
        elif ".query." in name or ".key." in name:
            param.copy_(query_key_std * noise)
        else:
            param.copy_(std * noise)


@dataclass
class TinyPoolingModel:
    """A saved tiny pooling checkpoint and what tests need to know of it."""

    name: str
    folder: Path
    task: str  # "embed" | "score"
    pooling_type: str  # "CLS" | "MEAN" | "LAST"
    normalize: bool
    embedding_size: int  # of an embedding, or the classifier head's input
    max_model_len: int
    matryoshka_dimensions: list[int] | None = None
    num_labels: int = 0
    prompts: dict[str, str] | None = None


def _encoder_config(model_type: str, vocab_size: int, **overrides) -> object:
    sizes = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "dtype": "float32",
    }
    return AutoConfig.for_model(model_type, **{**sizes, **overrides})


def _save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    model.eval().save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def _add_to_config(folder: Path, **values) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(values)
    path.write_text(json.dumps(config, indent=2) + "\n")


def _save_sentence_transformer(
    hf_folder: Path, folder: Path, pooling_mode: str, max_seq_length: int, prompts: dict[str, str] | None = None
) -> None:
    """The transformers checkpoint in hf_folder as sentence-transformers saves an embedding model:
    Transformer + Pooling + Normalize (modules.json, 1_Pooling/config.json, 2_Normalize)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(hf_folder), max_seq_length=max_seq_length)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)
    model = SentenceTransformer(modules=[transformer, pooling, Normalize()], prompts=prompts, device="cpu")
    model.save(str(folder))


def build_bert_embedder(folder: Path, seed: int = 6) -> TinyPoolingModel:
    """A BertModel embedder (mean pooling, normalised) declaring Matryoshka sizes 16, 32, 64 in config.json."""
    tokenizer = bert_tokenizer()
    config = _encoder_config("bert", len(tokenizer), max_position_embeddings=ENCODER_MAX_POSITIONS)
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32, add_pooling_layer=False)
    randomize_encoder(model, seed)
    with tempfile.TemporaryDirectory() as hf_folder:
        _save_hf(model, tokenizer, Path(hf_folder))
        _save_sentence_transformer(Path(hf_folder), folder, "mean", ENCODER_MAX_POSITIONS)
    _add_to_config(folder, matryoshka_dimensions=MATRYOSHKA_DIMENSIONS)
    return TinyPoolingModel(
        "bert_embedder",
        folder,
        task="embed",
        pooling_type="MEAN",
        normalize=True,
        embedding_size=64,
        max_model_len=ENCODER_MAX_POSITIONS,
        matryoshka_dimensions=MATRYOSHKA_DIMENSIONS,
    )


def _save_cross_encoder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """A sequence classifier as sentence-transformers' CrossEncoder saves one (read back with sigmoid for 1 label)."""
    from sentence_transformers import CrossEncoder

    with tempfile.TemporaryDirectory() as hf_folder:
        _save_hf(model, tokenizer, Path(hf_folder))
        CrossEncoder(hf_folder, device="cpu").save(str(folder))


def _cross_encoder(name: str, folder: Path) -> TinyPoolingModel:
    """A one-label reranker's description: the CLS row through the classifier head."""
    return TinyPoolingModel(
        name,
        folder,
        task="score",
        pooling_type="CLS",
        normalize=False,
        embedding_size=64,
        max_model_len=ENCODER_MAX_POSITIONS,
        num_labels=1,
    )


def build_xlmr_cross_encoder(folder: Path, seed: int = 14) -> TinyPoolingModel:
    """An XLMRobertaForSequenceClassification reranker with one label (as bge-reranker): positions offset by
    padding_idx + 1 = 2, one token type, two heads of 32 (the other tiny encoders have four of 16)."""
    tokenizer = xlmr_tokenizer()
    offset = tokenizer.pad_token_id + 1
    config = _encoder_config(
        "xlm-roberta",
        len(tokenizer),
        max_position_embeddings=ENCODER_MAX_POSITIONS + offset,
        type_vocab_size=1,
        num_attention_heads=2,  # head size 32: the CPU's C++ attention kernel (16 takes torch's)
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        num_labels=1,
    )
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_encoder(model, seed)
    _save_cross_encoder(model, tokenizer, folder)
    return _cross_encoder("xlmr_cross_encoder", folder)


def build_bert_cross_encoder(folder: Path, seed: int = 12) -> TinyPoolingModel:
    """A BertForSequenceClassification reranker with one label: a pair's token_type_ids change its score."""
    tokenizer = bert_tokenizer()
    config = _encoder_config("bert", len(tokenizer), max_position_embeddings=ENCODER_MAX_POSITIONS, num_labels=1)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_encoder(model, seed)
    _save_cross_encoder(model, tokenizer, folder)
    return _cross_encoder("bert_cross_encoder", folder)


def build_chat_cross_encoder(folder: Path, seed: int = 17) -> TinyPoolingModel:
    """A Qwen3ForSequenceClassification reranker with one label and a ChatML chat template, saved by
    sentence-transformers 6's CrossEncoder: `predict` renders a pair as a "query" and a "document" message."""
    tokenizer = chat_qwen_tokenizer()
    model_type, overrides = SPECS["qwen3"]
    config = AutoConfig.for_model(
        model_type,
        **{
            **COMMON,
            **overrides,
            "vocab_size": len(tokenizer),
            "num_labels": 1,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
    )
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_encoder(model, seed)
    _save_cross_encoder(model, tokenizer, folder)
    return TinyPoolingModel(
        "chat_cross_encoder",
        folder,
        task="score",
        pooling_type="LAST",
        normalize=False,
        embedding_size=COMMON["hidden_size"],
        max_model_len=COMMON["max_position_embeddings"],
        num_labels=1,
    )


def build_qwen3_embedder(folder: Path, seed: int = 15) -> TinyPoolingModel:
    """A tiny Qwen3 decoder saved as Qwen3-Embedding is: sentence-transformers with last-token pooling and
    Normalize, the Qwen3Model weights without the "model." prefix and no lm_head, named query/document prompts."""
    return _qwen3_embedder("qwen3_embedder", folder, seed, qwen_tokenizer())


def build_chat_embedder(folder: Path, seed: int = 16) -> TinyPoolingModel:
    """build_qwen3_embedder's model with a ChatML chat template, saved by sentence-transformers 6: its
    sentence_bert_config.json has a "message" modality, so `encode` renders each text through the template."""
    return _qwen3_embedder("chat_embedder", folder, seed, chat_qwen_tokenizer())


def _qwen3_embedder(name: str, folder: Path, seed: int, tokenizer: Qwen2Tokenizer) -> TinyPoolingModel:
    model_type, overrides = SPECS["qwen3"]
    config = AutoConfig.for_model(
        model_type,
        **{**COMMON, **overrides, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id},
    )
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32)
    randomize_encoder(model, seed)
    with tempfile.TemporaryDirectory() as hf_folder:
        _save_hf(model, tokenizer, Path(hf_folder))
        _save_sentence_transformer(
            Path(hf_folder), folder, "lasttoken", COMMON["max_position_embeddings"], prompts=QWEN3_PROMPTS
        )
    return TinyPoolingModel(
        name,
        folder,
        task="embed",
        pooling_type="LAST",
        normalize=True,
        embedding_size=COMMON["hidden_size"],
        max_model_len=COMMON["max_position_embeddings"],
        prompts=QWEN3_PROMPTS,
    )


BUILDERS = {
    "bert_embedder": build_bert_embedder,
    "xlmr_cross_encoder": build_xlmr_cross_encoder,
    "bert_cross_encoder": build_bert_cross_encoder,
    "qwen3_embedder": build_qwen3_embedder,
    "chat_embedder": build_chat_embedder,
    "chat_cross_encoder": build_chat_cross_encoder,
}
