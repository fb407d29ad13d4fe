"""Shared fixtures: the embedded model's directory and a fixed set of real-text prompts."""

from __future__ import annotations

import os

import pytest
import torch

# Original prose for prompts; long prompts repeat it from different offsets.
CORPUS = """\
The harbour town woke slowly that winter. Fishing boats rocked against the stone quay while
gulls argued over the morning catch, and the baker on Mill Street pulled the first loaves
from an oven older than anyone could remember. Children ran down the hill toward the school
house, their breath rising in small clouds, and the ferry captain checked the tide tables
twice before he trusted the weather.
In the library above the post office, a retired engineer was writing a history of the
lighthouse. He had found letters from the keeper's daughter, who described storms that
lasted nine days, ships that vanished in fog, and the night the great lamp failed and her
father climbed the tower with a ship's lantern in each hand. The letters were brittle, and he
copied every line by hand before the paper could crumble further.
Scheduling work on a shared machine is a question of fairness as much as speed. A request
that arrives first should usually be served first, but a short interactive question should
not wait behind a long batch report, and nobody should wait forever. Engineers measure the
time to the first token, the time between tokens, and how many requests finish within their
deadline, then tune the system until those numbers hold under the heaviest expected load.
def merge_sorted(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i]); i += 1
        else:
            result.append(right[j]); j += 1
    return result + left[i:] + right[j:]
Recipes from the old inn called for butter by the pound, flour by the sack and patience by
the hour. The stew simmered from dawn until dusk, and travellers who arrived late were given
bread, cheese and a seat by the fire, whatever the hour and whatever they could pay.
"""

PROMPT_LENGTHS = [
    1,
    2,
    3,
    5,
    8,
    12,
    17,
    24,
    33,
    45,
    60,
    80,
    105,
    135,
    170,
    210,
    260,
    315,
    375,
    440,
    510,
    580,
    640,
    700,
]


@pytest.fixture(scope="session")
def model_dir():
    """The embedded model's directory, or ``$ITERSERVE_TEST_MODEL``'s where it is set (a
    transformers directory or a ``.gguf`` file; ``bench.gpu_check --model`` sets it for
    ``tests/test_gpu.py``)."""
    from engine.model.loader import resolve_model_dir

    return resolve_model_dir(os.environ.get("ITERSERVE_TEST_MODEL") or None)


@pytest.fixture(scope="session")
def lora_dirs(model_dir, tmp_path_factory) -> dict[str, str]:
    """``tests.test_lora.ADAPTERS`` saved by peft once for the session: name -> directory
    (the engine tests, the API tests and the Ray server's test share them)."""
    from tests.test_lora import ADAPTERS, SEEDS, make_adapter

    root = tmp_path_factory.mktemp("loras")
    for name, config in ADAPTERS.items():
        make_adapter(model_dir, root / name, SEEDS[name], **config)
    return {name: str(root / name) for name in ADAPTERS}


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """24 token-id prompts of 1 to 700 tokens, cut from the corpus at varied offsets."""
    ids = tokenizer.encode(CORPUS)
    stream = ids * (1 + 2 * max(PROMPT_LENGTHS) // len(ids))
    out = []
    for k, n in enumerate(PROMPT_LENGTHS):
        start = (k * 37) % len(ids)
        out.append(stream[start : start + n])
    assert [len(p) for p in out] == PROMPT_LENGTHS
    return out


def pytest_collection_modifyitems(config, items):
    have_flash = False
    if torch.cuda.is_available():
        import importlib.util

        have_flash = importlib.util.find_spec("flash_attn") is not None
    skip = pytest.mark.skip(reason="needs CUDA and flash-attn")
    for item in items:
        if item.get_closest_marker("gpu") and not have_flash:
            item.add_marker(skip)
