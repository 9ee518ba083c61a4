"""Prefix caching with images: blocks covering an image's placeholder tokens are keyed by its content hash."""

from __future__ import annotations

import itertools

from heteroserve.core.kv_cache_manager import KVCacheManager
from heteroserve.core.request import ImagePlaceholder, Request
from heteroserve.sampling_params import SamplingParams

_ids = itertools.count()
PAD = 7
# 4 text tokens, 6 placeholder tokens (offset 4), 6 text tokens: blocks of 4 are [text][text|image x2]...
PROMPT = [1, 2, 3, 4] + [PAD] * 6 + [5, 6, 8, 9, 10, 11]


def image_request(content_hash: str) -> Request:
    request = Request(f"r{next(_ids)}", PROMPT, SamplingParams())
    request.image_placeholders = [ImagePlaceholder(4, 6, content_hash)]
    return request


def run_prompt(manager: KVCacheManager, request: Request) -> int:
    cached, num_cached = manager.find_cached_prefix(request)
    assert manager.allocate_slots(request, request.num_tokens - num_cached, cached)
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)
    return num_cached


def test_same_image_hits_and_another_image_stops_at_its_first_block() -> None:
    manager = KVCacheManager(32, 4)
    assert run_prompt(manager, image_request("cat")) == 0
    assert run_prompt(manager, image_request("cat")) == 12  # every full block but the last token's
    assert run_prompt(manager, image_request("dog")) == 4  # the text block before the image only


def test_text_requests_keep_their_plain_token_keys() -> None:
    manager = KVCacheManager(32, 4)
    text = [1, 2, 3, 4, 5, 6, 8, 9, 10]
    assert run_prompt(manager, Request("a", text, SamplingParams())) == 0
    assert run_prompt(manager, Request("b", text, SamplingParams())) == 8
