"""Tiny randomly initialised Qwen2-VL / Qwen2.5-VL checkpoints with a small tokenizer and image processor.

The tokenizer is a byte-level BPE trained here on a few sentences, with the Qwen chat tokens and a chat
template that writes `<|vision_start|><|image_pad|><|vision_end|>` for each image part, as Qwen-VL's does.
The transformers model saved in the folder is the reference; it computes its own M-RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, PreTrainedTokenizerFast

from heteroserve.entrypoints.llm import LLM
from tests.model.tiny_models import randomize
from tests.reference import HFReference

VOCAB = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] in ['image', 'image_url'] %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["Describe the picture in one sentence.", "What is in this image? A cat, a dog and a red ball."] * 20

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}
VISION = {
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
    # 56-pixel windows are 2x2 merged tokens, so a 10x14-patch image has 6 windows; block 1 attends fully.
    "qwen2_5_vl": {
        "depth": 3,
        "hidden_size": 32,
        "out_hidden_size": 64,
        "intermediate_size": 48,
        "num_heads": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    },
    # A 4x4 learned position grid (resized to each image) and DeepStack features from blocks 0 and 1.
    "qwen3_vl": {
        "depth": 3,
        "hidden_size": 32,
        "out_hidden_size": 64,
        "intermediate_size": 48,
        "num_heads": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1],
    },
}
PATCH_SIZE = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
# The image processor's pixel budget in merged tokens (2x2 patches each): small images, tens of tokens each.
MIN_TOKENS, MAX_TOKENS = 4, 64


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass
class TinyVL:
    name: str
    folder: Path
    model: torch.nn.Module  # the transformers reference
    tokenizer: PreTrainedTokenizerFast

    @property
    def image_token_id(self) -> int:
        return self.model.config.image_token_id

    def llm(self, **kwargs) -> LLM:
        kwargs.setdefault("max_model_len", 512)
        kwargs.setdefault("num_kv_blocks", 128)
        kwargs.setdefault("dtype", "float32")
        return LLM(model=str(self.folder), **kwargs)

    def reference(self, images: list[Image.Image]) -> VLReference:
        return VLReference(self, images)


def save_tiny_vl(model_type: str, root: Path, seed: int = 0) -> TinyVL:
    folder = root / model_type
    tokenizer = build_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIALS}
    config = AutoConfig.for_model(
        model_type,
        text_config=TEXT,
        vision_config={
            "patch_size": PATCH_SIZE[model_type],
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            **VISION[model_type],
        },
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        video_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize(model, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    processor_class = type(AutoImageProcessor.from_pretrained(_processor_seed(folder, model_type)))
    token_pixels = (2 * PATCH_SIZE[model_type]) ** 2
    processor_class(
        patch_size=PATCH_SIZE[model_type], min_pixels=MIN_TOKENS * token_pixels, max_pixels=MAX_TOKENS * token_pixels
    ).save_pretrained(folder)
    reference = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    reference.generation_config.eos_token_id = None
    reference.generation_config.pad_token_id = 0
    return TinyVL(model_type, folder, reference.eval(), tokenizer)


def _processor_seed(folder: Path, model_type: str) -> Path:
    """A folder whose config makes AutoImageProcessor pick the model's processor class (PIL where needed)."""
    seed = folder / "processor_seed"
    seed.mkdir(exist_ok=True)
    (seed / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    return seed


def image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


class VLReference(HFReference):
    """transformers on one fixed set of images: the prompt holds their expanded placeholder runs."""

    def __init__(self, tiny: TinyVL, images: list[Image.Image]) -> None:
        super().__init__(tiny.model, tiny.tokenizer)
        self.image_token_id = tiny.image_token_id
        self.pixel_values = self.grid_thw = None
        self.tokens_per_image: list[int] = []
        if images:
            out = AutoImageProcessor.from_pretrained(tiny.folder)(images=images, return_tensors="pt")
            self.pixel_values, self.grid_thw = out["pixel_values"], out["image_grid_thw"]
            merge = tiny.model.config.vision_config.spatial_merge_size
            self.tokens_per_image = (self.grid_thw.prod(-1) // merge**2).tolist()

    def expand(self, token_ids: list[int]) -> list[int]:
        """Each single placeholder token -> the image's run of them (what the processor's call would do)."""
        out, images = [], iter(self.tokens_per_image)
        for t in token_ids:
            out.extend([t] * next(images) if t == self.image_token_id else [t])
        self.prompt_length = len(out)
        return out

    def _inputs(self, token_ids: list[int]) -> dict:
        inputs = super()._inputs(token_ids)
        ids = inputs["input_ids"]
        if self.grid_thw is not None:
            inputs["pixel_values"] = self.pixel_values
            inputs["image_grid_thw"] = self.grid_thw
            inputs["mm_token_type_ids"] = (ids == self.image_token_id).int()
        return inputs

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Prompt, then the tokens after it on the cache (as generate does): a generated token that happens
        to be the placeholder id is then text, not a request for another image."""
        n = self.prompt_length
        self.model.model.rope_deltas = None  # transformers keeps the last prompt's; this prompt sets its own
        first = self.model(**self._inputs(token_ids[:n]), use_cache=True)
        if len(token_ids) == n:
            return first.logits[0].float()
        rest = self.model(
            input_ids=torch.tensor([token_ids[n:]]),
            cache=first.cache,
            use_cache=True,
        )
        return torch.cat((first.logits[0], rest.logits[0])).float()
