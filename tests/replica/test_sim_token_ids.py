"""The simulated replica refuses prompt token ids no vocabulary has, as vLLM does, and
keeps serving (it used to hash them and die)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from replica.sim.server import start_sim
from replica.vllm.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"), template="llama3")


async def test_out_of_range_ids_are_400_and_the_engine_lives_on(tokenizer_dir: Path) -> None:
    block = list(range(1, 17))
    async with start_sim(tokenizer_dir, model="m", time_scale=0.01) as sim:
        async with aiohttp.ClientSession() as http:
            for prompt in ([2**32, *block, *block], [[*block, *block, 2**40]]):
                async with http.post(sim.url + "/v1/completions",
                                     json={"model": "m", "prompt": prompt,
                                           "max_tokens": 2}) as resp:
                    assert resp.status == 400, await resp.text()
                    error = (await resp.json())["error"]
                    assert "out of vocabulary" in error["message"]
            async with http.post(sim.url + "/v1/completions",
                                 json={"model": "m", "prompt": [*block, *block],
                                       "max_tokens": 2}) as resp:
                assert resp.status == 200, await resp.text()
