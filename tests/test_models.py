"""Loading real Hugging Face checkpoints, numerics against `transformers`, and load errors."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch

from parity.engines.models import ModelError, load_model, resolve_model_dir, save_model
from parity.engines.packing import pack
from parity.engines.tokenizer import copy_tokenizer_files, load_tokenizer


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])
def test_packed_logits_match_transformers_fp32(fixture, request):
    """Shared prompts stored once, ragged responses, no padding: every stream
    position's logits equal transformers' on the row written out in full."""
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(fixture)
    ours = load_model(path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    short, long = torch.randint(3, 40, (3,), generator=gen).tolist(), torch.randint(3, 40, (9,), generator=gen).tolist()
    prompts = [short, short, long, long, long]
    lengths = [4, 1, 6, 3, 0]
    responses = torch.randint(3, 40, (5, 6), generator=gen)
    mask = torch.arange(6) < torch.tensor(lengths)[:, None]
    packed = pack(prompts, responses, mask)
    # The stream: each distinct prompt once, then every response without its last token.
    streamed = [max(n - 1, 0) for n in lengths]
    assert packed.num_tokens == 3 + 9 + sum(streamed)
    prompt_at = {0: list(range(0, 3)), 2: list(range(3, 12))}
    starts = (12 + torch.tensor([0] + streamed).cumsum(0)).tolist()
    with torch.no_grad():
        got = ours.logits(ours.hidden_states(packed, torch.float32))
        for row, prompt in enumerate(prompts):
            response_at = list(range(starts[row], starts[row] + streamed[row]))
            stream = torch.tensor(prompt_at[0 if row < 2 else 2] + response_at)
            full = torch.tensor(prompt + responses[row, : streamed[row]].tolist())
            assert torch.equal(packed.token_ids[stream], full)
            expected = ref(full[None]).logits[0]
            assert torch.allclose(got[stream], expected, atol=2e-5, rtol=1e-4), (got[stream] - expected).abs().max()


def test_save_roundtrip_loads_in_transformers(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    ours = load_model(llama_dir)
    out = save_model(ours, tmp_path / "copy", partial(copy_tokenizer_files, llama_dir))
    ref = AutoModelForCausalLM.from_pretrained(out)
    for name, p in ref.state_dict().items():
        assert torch.equal(p, ours.state_dict()[name]), name
    assert load_tokenizer(out).eos_id == 2


def test_tokenizer_special_ids(llama_dir):
    tok = load_tokenizer(llama_dir)
    assert (tok.eos_ids, tok.pad_id, tok.bos_id) == ((2,), 0, 1)
    ids = tok.encode("12+3=")
    assert ids[0] == 1 and tok.decode(ids) == "12+3="


def test_builtin_model_loads():
    model = load_model("builtin")
    tok = load_tokenizer("builtin")
    assert model.config.architecture == "llama"
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert tok.decode(tok.encode("123+45=")) == "123+45="


# ----------------------------------------------------------------------------- errors


def test_missing_directory():
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_dir("/nonexistent/model")


def _copy(src, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(src, d)
    return d


def test_missing_tokenizer(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer.json"):
        load_tokenizer(d)


def test_pickle_only_weights_refused(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    (d / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pickle files.*never unpickles"):
        load_model(d)


def test_unsupported_architecture(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture model_type=.gpt2.*llama, mistral, qwen2"):
        load_model(d)


def test_missing_config(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ModelError, match="no config.json"):
        load_model(d)


def test_cli_reports_model_error_in_one_line(capsys):
    from parity.cli import main

    assert main(["mismatch", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
