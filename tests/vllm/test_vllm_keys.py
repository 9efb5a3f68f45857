"""kvtier's vLLM block hashes (integrations/vllm/keys.py, no vLLM import) equal vLLM's own, algorithm by algorithm.

vLLM computes them on a real `Request` with its own request block hasher; kvtier from the token ids alone.
That the chunk keys derived from them are the records a real engine stores is test_vllm_prewarm.py.
"""

from __future__ import annotations

import random

import pytest

from support.vllm_harness import require_vllm

require_vllm()

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvtier.core.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm import keys  # noqa: E402

BLOCK = 16


def _vllm_hashes(tokens: list[int], algo: str, salt: str | None) -> list[bytes]:
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK, fn)
    req = Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=hasher)
    return list(req.block_hashes)


@pytest.mark.parametrize("algo", keys.HASH_ALGOS)
@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_block_hashes_equal_vllms(algo: str, salt: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(f"{algo}{salt}")
    tokens = [rng.randrange(0, 150_000) for _ in range(5 * BLOCK + 3)]
    seed = None
    if algo.startswith("xxhash"):  # vLLM seeds these from PYTHONHASHSEED (at random without it)
        seed = "4242"
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    else:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ours = keys.block_hashes(tokens, BLOCK, algo, seed, salt)
    assert len(ours) == 5
    assert ours == _vllm_hashes(tokens, algo, salt)
    # a different seed, salt or token is a different chain from there on
    other = list(tokens)
    other[3 * BLOCK] += 1
    changed = keys.block_hashes(other, BLOCK, algo, seed, salt)
    assert changed[:3] == ours[:3] and changed[3] != ours[3] and changed[4] != ours[4]


def test_xxhash_without_the_engines_seed_is_refused() -> None:
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        keys.block_hashes([1] * BLOCK, BLOCK, "xxhash")


def test_a_prompt_as_text_or_chat_is_the_checkpoints_tokens(tmp_path) -> None:
    """`text` is the tokenizer's encoding; `messages` the checkpoint's chat template, generation prompt appended."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from kvtier.cli.manifest import read_manifest

    model = tmp_path / "model"
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w1{% endif %}"
    )
    fast.save_pretrained(model)
    manifest = tmp_path / "m.jsonl"
    lines = [
        {"engine": "vllm", "model_dir": "model", "text": "w3 w4 w5"},
        {"engine": "vllm", "model_dir": "model", "messages": [{"role": "w5", "content": "w7 w9"}]},
    ]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text, chat = read_manifest(manifest)
    assert text.tokens.tolist() == [3, 4, 5]
    assert chat.tokens.tolist() == [5, 7, 9, 1]
