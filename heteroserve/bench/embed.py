"""`heteroserve bench embed`: passages of mixed lengths through an embedding model, ours against
sentence-transformers' `encode` with its default batching, in alternating rounds of the same run.

Without a model argument it builds a BERT encoder of full depth (12 layers, as BERT-base; bge-m3 has 24) and tiny
width (64: two heads of 32), with random weights and a word-level tokenizer over a synthetic vocabulary, saved as a
sentence-transformers folder (mean pooling, normalised), so nothing is downloaded and both sides read the same
weights and the same token ids. Each passage is `--min-tokens` to `--max-tokens` tokens long (uniform, seeded).
Both sides run in this process one after the other, on the same threads.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from heteroserve.bench.machine import describe_machine
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.engine.llm_engine import LLMEngine
from heteroserve.platforms.cpu.platform import process_threads, torch_at_process_threads
from heteroserve.pooling_params import PoolingParams

VOCABULARY_WORDS = 2000
HEAD_SIZE = 32  # as MiniLM's and bge-small's heads (BERT-base's and bge-m3's are 64)


def build_encoder_folder(folder: Path, hidden_size: int, layers: int, max_tokens: int, seed: int) -> None:
    """A random BERT of the given shape with a word-level tokenizer, saved as a sentence-transformers model."""
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, processors
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(VOCABULARY_WORDS)])}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden_size // HEAD_SIZE),
        intermediate_size=4 * hidden_size,
        max_position_embeddings=max_tokens,
    )
    torch.manual_seed(seed)
    model = BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm.weight" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.5 if "embeddings" in name else 0.2)
    raw = folder / "encoder"
    model.save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    transformer = models.Transformer(str(raw), max_seq_length=max_tokens)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu").save(str(folder))


def passages(count: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Texts of min_tokens..max_tokens tokens each with [CLS] and [SEP] (the built tokenizer: one token a word)."""
    rng = random.Random(seed)
    return [
        " ".join(f"w{rng.randrange(VOCABULARY_WORDS)}" for _ in range(rng.randint(min_tokens, max_tokens) - 2))
        for _ in range(count)
    ]


def embed(engine: LLMEngine, texts: list[str]) -> torch.Tensor:
    """Every text queued at once and stepped to the end, as LLM.embed does; the embeddings in text order."""
    params = PoolingParams()
    for i, text in enumerate(texts):
        engine.add_request(str(i), text, params)
    found: dict[str, torch.Tensor] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            found[output.request_id] = output.outputs.data
    return torch.stack([found[str(i)] for i in range(len(texts))])


def run_embed_bench(args: argparse.Namespace) -> dict:
    from sentence_transformers import SentenceTransformer

    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="heteroserve-bench-embed-") as scratch:
        folder = Path(args.model) if args.model else Path(scratch)
        if args.model is None:
            build_encoder_folder(folder, args.hidden_size, args.layers, args.max_tokens, args.seed)
        texts = passages(args.passages, args.min_tokens, args.max_tokens, args.seed)
        engine = LLMEngine(EngineArgs.from_cli_args(args, str(folder)).create_engine_config())
        reference = SentenceTransformer(str(folder), device="cpu")
        num_tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in texts)
        embed(engine, texts[:8])  # warm-up: first-use kernel builds and allocations
        with torch_at_process_threads():
            reference.encode(texts[:8], convert_to_tensor=True)
        ours_s: list[float] = []
        theirs_s: list[float] = []
        for index in range(args.rounds):
            start = time.perf_counter()
            ours = embed(engine, texts)
            ours_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            with torch_at_process_threads():
                theirs = reference.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True)
            theirs_s.append(time.perf_counter() - start)
            print(
                f"round {index + 1}: heteroserve {ours_s[-1]:.2f} s, sentence-transformers {theirs_s[-1]:.2f} s, "
                f"ratio {theirs_s[-1] / ours_s[-1]:.2f}x"
            )
        cosine = torch.nn.functional.cosine_similarity(ours, theirs.float(), dim=1)
        ratios = [t / o for o, t in zip(ours_s, theirs_s, strict=True)]
        result = {
            "command": "embed",
            "model": args.model or f"built BERT, {args.layers} layers, hidden {args.hidden_size}, random weights",
            "passages": len(texts),
            "tokens": num_tokens,
            "token_range": [args.min_tokens, args.max_tokens],
            "rounds": args.rounds,
            "heteroserve_s": ours_s,
            "sentence_transformers_s": theirs_s,
            "sentence_transformers_batch_size": args.st_batch_size,
            "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
            "heteroserve_passages_per_s": len(texts) / statistics.median(ours_s),
            "sentence_transformers_passages_per_s": len(texts) / statistics.median(theirs_s),
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios),
            "min_cosine_vs_sentence_transformers": float(cosine.min()),
            "threads": process_threads(),
            "machine": describe_machine(engine.platform),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        engine.shutdown()
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return result
