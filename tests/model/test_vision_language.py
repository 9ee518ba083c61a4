"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL against transformers on tiny random checkpoints, through the public `LLM` API.

Each image request is checked like the text models (tests/model/tiny_models.py `check_output`): prompt and
per-step logprobs of the whole vocabulary against transformers' logits (which computes its own M-RoPE
positions and image features), and greedy tokens against its `generate`.
"""

from __future__ import annotations

import base64
import io

import pytest

from heteroserve.multimodal.media import ImageError
from tests.model.tiny_models import check_output, greedy_params, save_tiny
from tests.model.tiny_vl import VOCAB, TinyVL, image, save_tiny_vl

QUESTION = "What is in this image?"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def tiny(request, tmp_path_factory) -> TinyVL:
    return save_tiny_vl(request.param, tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def llm(tiny):
    return tiny.llm(block_size=4)


def chat_ids(tiny: TinyVL, num_images: int, text: str = QUESTION) -> list[int]:
    parts = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    rendered = tiny.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    return tiny.tokenizer.encode(rendered, add_special_tokens=False)


def run_images(llm, ids: list[int], images, params=None):
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    return llm.generate(prompt, params or greedy_params(VOCAB), use_tqdm=False)[0]


def data_url(picture) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    "sizes",
    [[(100, 150)], [(300, 80)], [(100, 150), (60, 60)]],
    ids=["one-image", "wide-image", "two-images"],
)
def test_images_match_transformers(tiny, llm, sizes, greedy_comparison):
    images = [image(i, w, h) for i, (w, h) in enumerate(sizes)]
    reference = tiny.reference(images)
    ids = chat_ids(tiny, len(images))
    output = run_images(llm, ids, images)
    assert len(reference.tokens_per_image) == len(images) and min(reference.tokens_per_image) > 1
    check_output(f"{tiny.name}/{sizes}", output, reference.expand(ids), reference, greedy_comparison)


def test_chunked_prefill_splits_images_and_mixes_with_text(tiny, greedy_comparison):
    """A 7-token budget cuts each image's tokens across several steps, beside a text-only request."""
    llm = tiny.llm(block_size=4, max_num_batched_tokens=7)
    pictures = [[image(5, 90, 120)], [image(6, 120, 90), image(7, 56, 56)]]
    prompts = [{"prompt_token_ids": chat_ids(tiny, len(p)), "multi_modal_data": {"image": p}} for p in pictures]
    text_ids = chat_ids(tiny, 0, "A cat and a dog.")
    outputs = llm.generate([*prompts, {"prompt_token_ids": text_ids}], greedy_params(VOCAB), use_tqdm=False)
    for picture, prompt, output in zip(pictures, prompts, outputs, strict=False):
        reference = tiny.reference(picture)
        expanded = reference.expand(prompt["prompt_token_ids"])
        check_output(f"{tiny.name}/chunked", output, expanded, reference, greedy_comparison)
    text_reference = tiny.reference([])
    text_reference.expand(text_ids)
    check_output(f"{tiny.name}/text-beside-images", outputs[2], text_ids, text_reference, greedy_comparison)


def test_chat_with_data_url_equals_generate(tiny, llm):
    picture = image(8, 100, 150)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(picture)}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    params = greedy_params(VOCAB, prompt_logprobs=False)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    direct = run_images(llm, chat_ids(tiny, 1), [picture], params)
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_prefix_cache_keys_on_image_content(tiny):
    """The same image again reuses its blocks; another image of the same size (same token ids) does not."""
    llm = tiny.llm(block_size=4)
    params = greedy_params(VOCAB, prompt_logprobs=False, max_tokens=4)
    ids = chat_ids(tiny, 1)
    first = run_images(llm, ids, [image(9, 100, 150)], params)
    again = run_images(llm, ids, [image(9, 100, 150)], params)
    other = run_images(llm, ids, [image(10, 100, 150)], params)
    assert first.prompt_token_ids == other.prompt_token_ids
    image_start = first.prompt_token_ids.index(tiny.image_token_id)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == image_start // 4 * 4  # the text before the image only
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_bad_image_inputs(tiny, llm, tmp_path):
    ids = chat_ids(tiny, 1)
    picture = image(11, 64, 64)
    with pytest.raises(ValueError, match="2 images, more than the limit of 1"):
        tiny.llm(limit_mm_per_prompt={"image": 1}).generate(
            {"prompt_token_ids": chat_ids(tiny, 2), "multi_modal_data": {"image": [picture, picture]}}
        )
    with pytest.raises(ValueError, match="1 image placeholder tokens .* for 2 images"):
        run_images(llm, ids, [picture, picture])
    with pytest.raises(ImageError, match="cannot decode the image"):
        run_images(llm, ids, [b"not an image"])
    with pytest.raises(ImageError, match="remote image URLs are disabled"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
    assert not llm.engine.has_unfinished_requests()

    text_model = save_tiny("qwen2", tmp_path)
    with pytest.raises(ImageError, match="text-only model: it does not accept images"):
        text_model.llm().generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": picture}})
